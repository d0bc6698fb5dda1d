"""Methods that split a model into a head (the output layer) and a body and share only one of them."""

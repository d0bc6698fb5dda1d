"""The messages between server and clients and their byte encoding, and the Transport base that carries them."""

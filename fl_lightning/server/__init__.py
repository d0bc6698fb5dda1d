"""The server side of the boundary: the Federation (select, tasks, aggregate, evaluate, record), its helpers."""

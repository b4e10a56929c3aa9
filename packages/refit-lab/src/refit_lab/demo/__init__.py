"""`refit demo`: a real training loop refitting a fleet of engines, verified bit for bit."""

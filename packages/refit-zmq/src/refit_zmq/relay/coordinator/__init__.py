"""The coordinator (the controller's process): configures the tree and ends every transfer in
commit or abort on every relay."""

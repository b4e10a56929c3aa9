"""What every side of the relay protocol shares: frames and their parser, the API key and
CURVE, NACK codes and errors, the tree's shape, tuning, and the DEALER links and parallel
control requests every client of a relay uses."""

"""``python -m refit_zmq.relay``: see :mod:`refit_zmq.relay.cli`."""

import sys

from refit_zmq.relay.cli import main

sys.exit(main())

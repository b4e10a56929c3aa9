"""``python -m refit_zmq.relay``: see :mod:`refit_zmq.relay_cli`."""

import sys

from refit_zmq.relay_cli import main

sys.exit(main())

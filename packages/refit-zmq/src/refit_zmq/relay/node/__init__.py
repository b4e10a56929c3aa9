"""The relay process: its event loop, payload intake and staging, forwarding to children,
the local apply, the transfer ledger and the two-phase commit on the relay's side."""

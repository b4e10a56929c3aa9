"""Who does what in a collective refit: the contract the controller calls (``contract``: the
roles, the join request, what engines report), and the endpoints a trainer rank (``trainer``)
and an engine worker (``engine``) run, on the membership they share (``member``)."""

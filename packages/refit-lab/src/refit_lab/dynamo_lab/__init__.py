"""A lab fleet of Dynamo workers: Dynamo's real runtime and per-worker system server, serving
the RL admin routes over reference engines (:mod:`.worker`), started and stopped as processes
(:mod:`.fleet`). Needs ``refit-dynamo`` and ``ai-dynamo-runtime``; nothing here is imported
by ``import refit_lab``."""

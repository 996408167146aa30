"""The outbox: rows written with a job's result (``store``), relayed to a
provider once (``relay``), the relay woken after a commit (``wakeup``).
Import from the modules: the package imports nothing, so that a worker's
handler does not load the senders' HTTP clients."""

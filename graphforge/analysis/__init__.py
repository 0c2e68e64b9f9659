"""Read-only analyses of a model, below placement and the runtime: sizes (``size``), the
dims a program fixes from those given (``dims``), FLOPs and bytes per node (``cost``),
liveness and a run's predicted peak memory (``memory``), nodes that wait for the host
(``host_sync``), and balanced cuts of a chain (``partition``). None of them changes a model
or runs a session."""

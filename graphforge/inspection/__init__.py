"""What ``graphforge inspect`` prints: a model's summary (summary.py: inputs and outputs,
parameters, roles, ops, a pipeline's stages, a ZeRO program's shards), the predicted memory
of a run or a training step (memory.py, ``--memory``), and the nodes that wait for the host
(host_syncs.py, ``--host-syncs``)."""

"""What ``graphforge inspect`` prints beyond a model's summary: the predicted memory of a run
or a training step (``--memory``), and the nodes that wait for the host (``--host-syncs``)."""

"""``graphforge plan``: which split of N processes trains a config fastest within a memory
per process, predicted without running anything.

``planner`` compiles each candidate split's program through the PassManager (for shapes
alone: the weights are never read) and predicts its step from the cost model, the memory
model and the pipeline schedule simulator; ``configs`` reads a ``graphforge train`` config
for it and writes the config back with the split picked; ``report`` is what the command
prints of a plan (its table, the splits refused, the one that fits best). A tool: it sits
above the passes, the runtime's cut and the distributed schedules it reads, and nothing
below imports it.
"""

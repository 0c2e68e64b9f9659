"""Where the parts of a program go: cut into segments (``cut``), pipeline stages
(``stages``), gradient buckets and shards (``buckets``), and the precision each node computes
in (``precision``). Read by passes and the runtime alike; none of it runs a session."""

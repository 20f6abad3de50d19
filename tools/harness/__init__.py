"""What tests and benchmarks share: in-process nodes and a reference coordinator session (nodes), a daemon
in a subprocess (daemon), hostile inputs (hostile), the sampled-speculation distribution test (distribution),
a call in a process of its own for process-wide figures such as MLX's memory (isolated).
Tools never import tests/."""

"""What tests and benchmarks share: in-process nodes and a reference coordinator session (nodes), a daemon
in a subprocess (daemon), hostile inputs (hostile), the sampled-speculation distribution test (distribution).
Tools never import tests/."""

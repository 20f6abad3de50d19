"""The `provider` command line: the parser (`cli`), and one module per subcommand that needs more than a few lines
(generate, status, models, verify, doctor, bench, service, the page link) with the client they reach a running
daemon through (`daemon_client`). The top floor: a command may import any part of the node; no part of the node
imports a command (tests/test_architecture.py)."""

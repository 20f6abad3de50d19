"""Work the network can check (docs/verification.md).

A node commits, for every generated token, to the largest entries of the model's final-norm hidden state at
the position that produced it (provider.proofs: `hidden_tap`, `commitment`), and draws sampled tokens from seeded Gumbel noise
keyed by output position (provider.engine.sampling). A verifier reads prompt + output in one prefill and
compares its own hidden states with the commitment and its own distributions with the tokens (`verifier`,
`replay`), and judges by measured tolerances (`verdict`).
"""

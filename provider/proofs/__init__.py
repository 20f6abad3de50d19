"""What a proof is made of, below everything that makes or reads one: the tap on a model's final-norm hidden state
(`hidden_tap`), the commitment to each position's largest entries (`commitment`) and the field its polynomials
live in (`field`). The engine builds commitments as it generates; models and drafters install taps; the verifier
(provider.verification) reads them back (docs/verification.md).

`field` and `commitment` are plain numpy (no MLX): the coordinator's side can read them too.
"""

"""Write tests/vectors/sealing.json: golden values for sealed jobs, from fixed keys, for other implementations.

    python tools/scripts/sealing_vectors.py          # (re)write the file
    python tools/scripts/sealing_vectors.py --check  # exit 1 if the checked-in file differs from what this code makes

Every value is hex. The construction is in proto/provider/v1/provider.proto, above `message Sealed`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from coordinator_client.outcomes import token_digest
from coordinator_client.pb import provider_pb2 as pb
from coordinator_client.sealing import COMPLETION_COUNTER, SealingKey, aad, derive_keys, nonce, seal_job

OUT = Path(__file__).resolve().parents[2] / "tests" / "vectors" / "sealing.json"
NODE_SECRET = bytes(range(1, 33))
SENDER_SECRET = bytes(range(101, 133))
JOB_ID = "job-golden-1"
RUN_SALT = bytes(range(201, 217))  # the node draws one per run; fixed here


def vectors() -> dict:
    node = SealingKey(X25519PrivateKey.from_private_bytes(NODE_SECRET))
    sender = X25519PrivateKey.from_private_bytes(SENDER_SECRET)
    body = pb.JobRequest(prompt="Hello, sealed world", max_tokens=8,
                         sampling=pb.SamplingParams(temperature=0.0))
    sealed, sender_keys = seal_job(node.public_key, JOB_ID, body, sender)
    keys = sender_keys.for_run(RUN_SALT)
    shared = sender.exchange(X25519PublicKey.from_public_bytes(node.public_key))
    request_key, response_key, digest_key = derive_keys(shared, sealed.sender_key, node.public_key, JOB_ID, RUN_SALT)
    chunk = {"seq": 3, "text": " tokens", "token_ids": [17, 4, 250]}
    completion = {"text": "Hello back", "token_ids": [9, 8, 7, 6]}
    return {
        "construction": "see proto/provider/v1/provider.proto, above `message Sealed`",
        "node_secret": NODE_SECRET.hex(), "sealing_key": node.public_key.hex(),
        "sender_secret": SENDER_SECRET.hex(), "sender_key": sealed.sender_key.hex(),
        "shared_secret": shared.hex(), "request_key": request_key.hex(), "response_key": response_key.hex(),
        "digest_key": digest_key.hex(),
        "job_id": JOB_ID, "run_salt": RUN_SALT.hex(),
        "job": {"plaintext": body.SerializeToString().hex(), "nonce": nonce(0).hex(),
                "aad": aad(JOB_ID, "job").hex(), "ciphertext": sealed.ciphertext.hex()},
        "chunk": chunk | {"nonce": nonce(chunk["seq"]).hex(), "aad": aad(JOB_ID, "chunk").hex(),
                          "ciphertext": keys.seal_chunk(JOB_ID, chunk["seq"], pb.TokenChunk(
                              text=chunk["text"], token_ids=chunk["token_ids"])).hex()},
        "completion": completion | {"nonce": nonce(COMPLETION_COUNTER).hex(), "aad": aad(JOB_ID, "completion").hex(),
                                    "ciphertext": keys.seal_completion(JOB_ID, pb.Completion(
                                        text=completion["text"], token_ids=completion["token_ids"])).hex(),
                                    "token_ids_sha256": token_digest(completion["token_ids"], keys).hex()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    text = json.dumps(vectors(), indent=1) + "\n"
    if ap.parse_args().check:
        same = OUT.exists() and OUT.read_text() == text
        print("sealing vectors match" if same else f"{OUT} differs from what the code makes")
        return 0 if same else 1
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

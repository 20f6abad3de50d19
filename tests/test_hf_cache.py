"""A repo id served from the Hugging Face cache with no network (HF_HUB_OFFLINE=1), through the real CLI."""

import hashlib
import os
import shutil

import openai

from tests.helpers import LocalServer


def _into_hf_cache(src, cache, repo_id: str):
    """Lay a checkpoint out as huggingface_hub does: blobs, a snapshot of symlinks, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, repo / "blobs" / digest)
        os.symlink(os.path.relpath(repo / "blobs" / digest, snap), snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_repo_id_loads_offline_from_the_hf_cache(fixtures_dir, tmp_path):
    cache = tmp_path / "hf-hub"
    _into_hf_cache(fixtures_dir / "qwen3-tiny", cache, "acme/qwen3-tiny")
    srv = LocalServer(None, tmp_path, "--model", "acme/qwen3-tiny",
                      env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.token, max_retries=0)
        assert [m.id for m in client.models.list()] == ["acme/qwen3-tiny"]
        r = client.completions.create(model="acme/qwen3-tiny", prompt="hello", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens >= 1
    finally:
        assert srv.stop() == 0

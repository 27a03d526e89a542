"""Test double for the Hugging Face Hub (tests/cli/test_cli_user.py: put this folder first on PYTHONPATH): HfApi.create_repo / upload_folder record their calls
in $FAKE_HUB_LOG (JSON lines) instead of reaching the network."""

import json
import os
import types


def _install():
    log = os.environ.get("FAKE_HUB_LOG")
    if not log:
        return
    import huggingface_hub

    def record(entry):
        with open(log, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def create_repo(self, repo_id, *args, **kwargs):
        record({"call": "create_repo", "repo_id": repo_id})
        return types.SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"fake-user/{repo_id}")

    def upload_folder(self, *args, repo_id=None, folder_path=None, ignore_patterns=None, **kwargs):
        import fnmatch

        files = []
        for root, _, names in os.walk(folder_path):
            for name in names:
                rel = os.path.relpath(os.path.join(root, name), folder_path)
                if not any(
                    fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(rel.split(os.sep)[0], p) for p in ignore_patterns or []
                ):
                    files.append(rel)
        record({"call": "upload_folder", "repo_id": repo_id, "files": sorted(files)})

    huggingface_hub.HfApi.create_repo = create_repo
    huggingface_hub.HfApi.upload_folder = upload_folder


_install()

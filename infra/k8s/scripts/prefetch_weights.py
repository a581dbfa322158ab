import json, pathlib, sys, time
from huggingface_hub import snapshot_download

repo, target, marker = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
done = target / marker
if done.is_file():
    print(f"{repo}: already complete in {target}")
    sys.exit(0)
started = time.monotonic()
snapshot_download(repo_id=repo, local_dir=str(target))
files = sorted(
    str(p.relative_to(target)) for p in target.rglob("*") if p.is_file() and ".cache" not in p.parts
)
seconds = round(time.monotonic() - started)
done.write_text(json.dumps({"repo": repo, "files": files, "seconds": seconds}) + "\n")
print(f"{repo}: {len(files)} files in {target} in {seconds} s")

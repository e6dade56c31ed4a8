"""Checks a bundle's hashes (docs/bundle-format.md, "Integrity") with Python's
hashlib, a third SHA-256 beside ce-gen's (LLVM's) and the runtime's: each
object's `sha256`, and `manifest_sha256` over the manifest with its digits as
zeros. Prints one line per hash for FileCheck."""

import hashlib
import json
import pathlib
import sys

bundle = pathlib.Path(sys.argv[1])
text = (bundle / "manifest.json").read_bytes()
manifest = json.loads(text)
for entry in manifest["objects"]:
    digest = hashlib.sha256((bundle / entry["file"]).read_bytes()).hexdigest()
    verdict = "ok" if digest == entry["sha256"] else f"MISMATCH {digest}"
    print(f"{entry['file']}: sha256 {verdict}")
seal = manifest["manifest_sha256"].encode()
written = b'"manifest_sha256": "' + seal + b'"'
if text.count(written) != 1:
    sys.exit("manifest_sha256 is not written as plain digits exactly once")
zeroed = text.replace(written, b'"manifest_sha256": "' + b"0" * 64 + b'"')
digest = hashlib.sha256(zeroed).hexdigest().encode()
print("manifest_sha256", "ok" if digest == seal else f"MISMATCH {digest.decode()}")

#!/usr/bin/python3
"""Builds the training corpus of the trained miniature from text shipped in Debian packages.

Contract:
  build_corpus.py --out DIR [--manifest PATH] [--compare PATH]
writes DIR/train.txt and DIR/val.txt (UTF-8 text, documents concatenated, each ending in a
newline) and a manifest (default DIR/corpus-manifest.json) naming every file used: split,
category, package, version, path, bytes and sha256 of the text taken from it.

The corpus is an agent-like mix of four categories, each with a byte budget (train and
validation) and a per-file cap (a longer file is cut at the last newline before the cap):
  code     Python stdlib, C and C++ headers, CMake and Perl modules
  logs     test-suite logs (gdb, Python, binutils) and upstream / Debian changelogs
  manuals  man pages rendered by man-db (`man -l`, 80 columns, C.UTF-8, no formatting)
  prose    licenses, release notes, NEWS and README files, Vim's help text
Only files owned by the packages in PACKAGES are read (their `dpkg -L` lists), so the corpus
depends only on those packages' versions, which the manifest records.

Determinism: every file gets key = sha256("kvtier-corpus-v1:" + path). Files are visited in
key order; the split is by file: a file whose key is 0 mod VAL_MODULUS goes to validation,
every other file to train; the first file that does not fit its category's budget closes that
budget. Identical texts (the same changelog shipped by two packages) count once.
--compare PATH reports whether the new manifest equals PATH (the committed
train/corpus-manifest.json); a difference (other package versions) is a warning, not an error.
"""

import argparse
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys

# Every package the corpus reads, by the category rules below; deploy/install-deps.sh
# --with-train installs the same list.
PACKAGES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus-packages.txt")


def read_packages(path=PACKAGES_FILE):
    with open(path, encoding="utf-8") as f:
        return [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]


PACKAGES = read_packages()

# Bytes per category (train, validation) and the per-file cap.
BUDGETS = {
    "code": (12_000_000, 400_000, 96_000),
    "logs": (8_000_000, 270_000, 512_000),
    "manuals": (6_000_000, 200_000, 128_000),
    "prose": (6_000_000, 200_000, 256_000),
}
VAL_MODULUS = 16
MIN_FILE_BYTES = 512  # stubs (".so" man redirections, empty modules) are skipped
RENDER_TIMEOUT_S = 30

CODE_RE = re.compile(
    r"^(/usr/lib/python3\.11/(?!test/|lib2to3/tests/|idlelib/idle_test/).*\.py"
    r"|/usr/include/.*\.(h|tcc)|/usr/include/c\+\+/12/[a-z_]+"
    r"|/usr/share/cmake-3\.25/Modules/.*\.cmake|/usr/share/perl/5\.36/.*\.pm)$")
LOG_RE = re.compile(
    r"^/usr/share/doc/[^/]+/(changelog(\.Debian)?\.gz|check\.log\.gz|test_results\.gz"
    r"|test-summary-[a-z0-9]+\.gz|pybench\.log)$")
MAN_RE = re.compile(r"^/usr/share/man/man[1-8]/[^/]+\.[1-8][a-z]*\.gz$")
PROSE_RE = re.compile(
    r"^(/usr/share/common-licenses/[^/]+|/usr/share/doc/git/RelNotes/[^/]+\.txt"
    r"|/usr/share/doc/[^/]+/(NEWS(\.Debian)?|README[^/]*|HISTORY)(\.gz)?"
    r"|/usr/share/vim/vim90/doc/[^/]+\.txt)$")


def category_of(path):
    """Returns the category of a package file, or None when it is not corpus text."""
    for name, rule in (("code", CODE_RE), ("logs", LOG_RE), ("manuals", MAN_RE),
                       ("prose", PROSE_RE)):
        if rule.match(path):
            return name
    return None


def package_versions():
    """Maps each package in PACKAGES to its installed version; exits when one is missing."""
    out = subprocess.run(["dpkg-query", "-W", "-f", "${Package}\t${Version}\t${Status}\n"]
                         + PACKAGES, capture_output=True, text=True, check=False).stdout
    versions = {}
    for line in out.splitlines():
        name, version, status = line.split("\t")
        if status.endswith("installed") and " not-installed" not in status:
            versions[name] = version
    missing = [p for p in PACKAGES if p not in versions]
    if missing:
        sys.exit("build_corpus: packages not installed: " + " ".join(missing)
                 + " (run deploy/install-deps.sh --with-train)")
    return versions


def candidate_files():
    """Yields (key, path, package, category) for every corpus file of PACKAGES, key order."""
    seen = set()
    found = []
    for pkg in PACKAGES:
        listing = subprocess.run(["dpkg", "-L", pkg], capture_output=True, text=True,
                                 check=True).stdout
        for path in sorted(listing.splitlines()):
            cat = category_of(path)
            if cat is None or path in seen or not os.path.isfile(path) or os.path.islink(path):
                continue
            seen.add(path)
            key = hashlib.sha256(("kvtier-corpus-v1:" + path).encode()).hexdigest()
            found.append((key, path, pkg, cat))
    found.sort()
    return found


def render_man(path):
    """Renders a man page as plain text the way `man` shows it on an 80-column terminal."""
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "MANWIDTH": "80", "MANPAGER": "cat",
           "PAGER": "cat"}
    r = subprocess.run(["man", "-l", path], capture_output=True, env=env,
                       timeout=RENDER_TIMEOUT_S, check=False)
    return r.stdout if r.returncode == 0 else b""


def read_text(path, category):
    """Returns the file's text as bytes, or None when it is not clean UTF-8 text."""
    if category == "manuals":
        with gzip.open(path, "rb") as f:
            if f.read(4) == b".so ":
                return None  # a redirection to another page
        data = render_man(path)
    elif path.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            data = f.read()
    else:
        with open(path, "rb") as f:
            data = f.read()
    if b"\0" in data:
        return None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return data


def cap(data, limit):
    """Cuts data to at most limit bytes at the last newline, and ends it with a newline."""
    if len(data) > limit:
        cut = data.rfind(b"\n", 0, limit)
        data = data[:cut + 1] if cut > 0 else data[:limit]
    if not data.endswith(b"\n"):
        data += b"\n"
    return data


def build(out_dir):
    """Selects, reads and writes the corpus. Returns the manifest dict."""
    versions = package_versions()
    totals = {(c, s): 0 for c in BUDGETS for s in ("train", "val")}
    seen_text = set()
    full = set()
    entries = []
    streams = {"train": [], "val": []}
    for key, path, pkg, cat in candidate_files():
        train_budget, val_budget, file_cap = BUDGETS[cat]
        is_val = int(key[:8], 16) % VAL_MODULUS == 0
        split = "val" if is_val else "train"
        budget = val_budget if is_val else train_budget
        if (cat, split) in full:
            continue
        data = read_text(path, cat)
        if data is None or len(data) < MIN_FILE_BYTES:
            continue
        data = cap(data, file_cap)
        digest = hashlib.sha256(data).hexdigest()
        if digest in seen_text:
            continue
        if totals[(cat, split)] + len(data) > budget:
            full.add((cat, split))  # the first file that does not fit closes the budget
            continue
        seen_text.add(digest)
        totals[(cat, split)] += len(data)
        streams[split].append(data)
        entries.append({"split": split, "category": cat, "package": pkg,
                        "version": versions[pkg], "path": path, "bytes": len(data),
                        "sha256": digest})
    os.makedirs(out_dir, exist_ok=True)
    summary = {}
    for split, parts in streams.items():
        blob = b"".join(parts)
        with open(os.path.join(out_dir, split + ".txt"), "wb") as f:
            f.write(blob)
        summary[split] = {"bytes": len(blob), "files": len(parts),
                          "sha256": hashlib.sha256(blob).hexdigest(),
                          "by_category": {c: totals[(c, split)] for c in BUDGETS}}
    return {"format": "kvtier-corpus-manifest-v1",
            "rules": {"key": "sha256('kvtier-corpus-v1:' + path)",
                      "val": "int(key[:8], 16) %% %d == 0" % VAL_MODULUS,
                      "budgets_bytes": {c: {"train": b[0], "val": b[1], "file_cap": b[2]}
                                        for c, b in BUDGETS.items()}},
            "packages": {p: versions[p] for p in PACKAGES},
            "summary": summary, "files": entries}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for train.txt and val.txt")
    ap.add_argument("--manifest", help="manifest path (default OUT/corpus-manifest.json)")
    ap.add_argument("--compare", help="manifest to compare the result with (warning only)")
    args = ap.parse_args()
    manifest_path = args.manifest or os.path.join(args.out, "corpus-manifest.json")
    manifest = build(args.out)
    for split, s in manifest["summary"].items():
        print("build_corpus: %s %d bytes in %d files %s sha256 %s" % (
            split, s["bytes"], s["files"], s["by_category"], s["sha256"]))
    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    with open(manifest_path, "w", encoding="utf-8") as f:
        f.write(text)
    if args.compare:
        with open(args.compare, encoding="utf-8") as f:
            same = f.read() == text
        print("build_corpus: %s %s" % ("identical to" if same else
                                       "WARNING: differs from (other package versions?)",
                                       args.compare))


if __name__ == "__main__":
    main()

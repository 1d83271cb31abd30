#!/usr/bin/env python3
"""The code's shape limits (issue #20), checked on every test run.

  * no file in engine/src over 500 lines: the engine is components, each in
    its own files (docs/architecture.md has the map);
  * no function over 80 lines in the library, tool and bench sources:
    everything tracked outside tests/ and testing/, except nanobind tables
    (a function whose body defines Python bindings: `.def(` calls and
    `nb::class_`), which are long lists, not long logic.

A function is found the way a reader finds one: a `{` whose head (the code
before it on its line, or the line above when the brace stands alone) ends
with a parameter list's `)`, possibly followed by const, noexcept, override,
a trailing return type or a constructor's initialisers, and is not an if,
for, while, switch or catch. Only the outermost such body counts: lambdas
and local classes are part of the function they sit in. Comments, string
and character literals are blanked first, so braces in them do not count.

Usage: check_structure.py ROOT        check the tree at ROOT
       check_structure.py --self-test check the checker on made-up sources
"""
import re
import subprocess
import sys
from pathlib import Path

FILE_LIMIT = 500          # lines, files in engine/src
FUNCTION_LIMIT = 80       # lines, from the opening brace's line to the closing one's
SOURCE_SUFFIXES = {".cpp", ".h", ".cu", ".cuh", ".hpp"}
EXEMPT_DIRS = ("tests/", "testing/")

_HEAD_IS_FUNCTION = re.compile(
    r"\)\s*(?:const|noexcept(?:\([^)]*\))?|override|final|mutable|->\s*[\w:<>,\s*&]+|\s)*$")
_INITIALISERS = re.compile(r"\)\s*:\s*[\w:]+[({].*[)}]\s*$")
_CONTROL = re.compile(r"\b(?:if|for|while|switch|catch)\s*\(|^\s*(?:else|do|try)\b")


def blank_comments_and_literals(text):
    """The text with comments, strings and character literals replaced by
    spaces (newlines kept), so that line numbers stay and braces in them vanish."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if m is None:
                out.append(c)
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i)
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isalnum():  # a digit separator: 1'000'000
                out.append(" ")
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(" " * (j - i))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def long_functions(text, limit=FUNCTION_LIMIT):
    """[(first line, lines)] of the outermost function bodies longer than limit."""
    lines = blank_comments_and_literals(text).split("\n")
    found = []
    stack = []  # (line index, is a function body, exempt)
    for i, line in enumerate(lines):
        for j, ch in enumerate(line):
            if ch == "{":
                head = line[:j].rstrip()
                if not head.strip() and i > 0:
                    head = lines[i - 1].rstrip()
                is_fn = bool(_HEAD_IS_FUNCTION.search(head) or _INITIALISERS.search(head)) and not _CONTROL.search(head)
                inside_fn = any(s[1] for s in stack)
                stack.append((i, is_fn and not inside_fn))
            elif ch == "}" and stack:
                start, is_fn = stack.pop()
                if is_fn and i - start + 1 > limit:
                    body = "\n".join(text.split("\n")[start:i + 1])
                    if ".def(" in body or "nb::class_" in body or "NB_MODULE" in body:
                        continue  # a nanobind table
                    found.append((start + 1, i - start + 1))
    return found


def tracked_sources(root):
    out = subprocess.run(["git", "-C", str(root), "ls-files"], check=True, capture_output=True, text=True).stdout
    return [p for p in out.split() if Path(p).suffix in SOURCE_SUFFIXES]


def check(root):
    problems = []
    files = tracked_sources(root)
    if not any(f.startswith("engine/src/") for f in files):
        return [f"{root}: no engine/src sources tracked; is this the repository root?"]
    for rel in files:
        text = (Path(root) / rel).read_text(encoding="utf-8", errors="replace")
        n = text.count("\n") + (0 if text.endswith("\n") else 1)
        if rel.startswith("engine/src/") and n > FILE_LIMIT:
            problems.append(f"{rel}: {n} lines, over the {FILE_LIMIT} allowed in engine/src; split it along its components")
        if rel.startswith(EXEMPT_DIRS):
            continue
        for first, length in long_functions(text):
            problems.append(f"{rel}:{first}: a function of {length} lines, over the {FUNCTION_LIMIT} allowed")
    return problems


def self_test():
    """The checker finds what it must and nothing else."""
    body = "\n".join(f"  x += {k};" for k in range(FUNCTION_LIMIT - 2))
    at_limit = f"int f(int x) {{\n{body}\n}}\n"              # exactly the limit: allowed
    over = f"int g(int x) const {{\n{body}\n  x++;\n}}\n"     # one more: flagged
    ctor = f"Foo::Foo(int a) : a_(a) {{\n{body}\n  a_++;\n}}\n"
    alone = f"Status Foo::run(int a,\n                 int b)\n{{\n{body}\n  b++;\n}}\n"
    control = f"void h() {{\n  if (x) {{\n{body}\n  }}\n}}\n"  # 83 lines, flagged once as h, not as the if
    tricky = ('int k() {\n  const char* s = "}}}}";  // }\n  /* { */ char c = \'{\';\n' + body + "\n}\n")
    table = "void bind(nb::module_& m) {\n" + "\n".join('  m.def("f", &f);' for _ in range(100)) + "\n}\n"
    lambda_inside = f"void outer() {{\n  auto l = [&]() {{\n{body}\n  }};\n}}\n"
    cases = [
        (at_limit, []),
        (over, [(1, FUNCTION_LIMIT + 1)]),
        (ctor, [(1, FUNCTION_LIMIT + 1)]),
        (alone, [(3, FUNCTION_LIMIT + 1)]),
        (control, [(1, FUNCTION_LIMIT + 2)]),
        (tricky, [(1, FUNCTION_LIMIT + 2)]),  # braces in literals and comments do not close it early
        (table, []),
        (lambda_inside, [(1, FUNCTION_LIMIT + 2)]),
        ("namespace a {\nstruct S {\n" + body + "\n};\n}\n", []),
    ]
    failures = 0
    for k, (src, want) in enumerate(cases):
        got = long_functions(src)
        if got != want:
            print(f"self-test case {k}: found {got}, expected {want}")
            failures += 1
    print("self-test", "ok" if failures == 0 else f"FAILED ({failures})")
    return failures == 0


def main(argv):
    if len(argv) == 2 and argv[1] == "--self-test":
        return 0 if self_test() else 1
    if len(argv) != 2:
        print(__doc__)
        return 2
    problems = check(argv[1])
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} shape problem(s) (issue #20's limits; tests/structure/check_structure.py)")
        return 1
    print("structure ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""The GitHub Classroom autograding workflow, made from the curriculum (``dojo dev classroom``).

An instructor copies ``dojo/classroom/autograding.yml`` to ``.github/workflows/classroom.yml`` in
the assignment's template repository: every push runs ``dojo check kNN`` per kata, each kata worth
its points, and GitHub Classroom collects the score. ``dojo dev check`` fails while the file is
stale, so a new kata cannot be missing from it.
"""

from __future__ import annotations

from dojo import curriculum

TEMPLATE = curriculum.DOJO / "classroom" / "autograding.yml"
POINTS_PER_KATA = 10
MINUTES_PER_KATA = 15


def workflow() -> str:
    lines = [
        "# GitHub Classroom autograding for torch-dist-katas: one graded step per kata.",
        "# Made by `python -m dojo dev classroom` from dojo/curriculum/; copy it to",
        "# .github/workflows/classroom.yml in the assignment's template repository.",
        "# Protect tests/ and dojo/ in the assignment (or grade with `dojo grade`, which uses",
        "# your own copy of them): a learner who edits them could pass their own tests.",
        "name: Autograding Tests",
        "'on':",
        "- push",
        "- repository_dispatch",
        "permissions:",
        "  checks: write",
        "  actions: read",
        "  contents: read",
        "jobs:",
        "  run-autograding-tests:",
        "    runs-on: ubuntu-latest",
        "    if: github.actor != 'github-classroom[bot]'",
        "    steps:",
        "    - name: Checkout code",
        "      uses: actions/checkout@v4",
        "    - name: Set up Python",
        "      uses: actions/setup-python@v5",
        "      with:",
        "        python-version: '3.11'",
        "    - name: Install (torch for the CPU, then the katas)",
        "      run: |",
        "        python -m pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu",
        "        python -m pip install -e .",
    ]
    ids = []
    for kata in curriculum.katas():
        step_id = f"{kata.id}-{kata.module.split('_', 1)[1].replace('_', '-')}"
        ids.append(step_id)
        lines += [
            f"    - name: {kata.id} {kata.title}",
            f"      id: {step_id}",
            "      uses: classroom-resources/autograding-command-grader@v1",
            "      with:",
            f"        test-name: {kata.id} {kata.title}",
            "        setup-command: ''",
            f"        command: python -m dojo check {kata.id}",
            f"        timeout: {MINUTES_PER_KATA}",
            f"        max-score: {POINTS_PER_KATA}",
        ]
    lines += [
        "    - name: Autograding Reporter",
        "      uses: classroom-resources/autograding-grading-reporter@v1",
        "      env:",
        *(f'        {i.upper()}_RESULTS: "${{{{steps.{i}.outputs.result}}}}"' for i in ids),
        "      with:",
        f"        runners: {','.join(ids)}",
    ]
    return "\n".join(lines) + "\n"


def problems() -> list[str]:
    if not TEMPLATE.exists() or TEMPLATE.read_text(encoding="utf-8") != workflow():
        return ["dojo/classroom/autograding.yml is stale: run `python -m dojo dev classroom`"]
    return []


def write() -> None:
    TEMPLATE.parent.mkdir(exist_ok=True)
    TEMPLATE.write_text(workflow(), encoding="utf-8")

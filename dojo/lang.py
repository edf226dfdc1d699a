"""The learner's language: English, or Chinese (the language the tutorial was written in).

``--lang zh`` (the runner sets ``DOJO_LANG``, which pytest and programs inherit), else
``DOJO_LANG``, else the locale (``LC_ALL``, ``LC_MESSAGES``, ``LANG`` such as ``zh_CN.UTF-8``),
else English. Lessons and hints in Chinese live in ``dojo/curriculum/zh/``; the runner's main
sentences are here, by key, in both languages.
"""

from __future__ import annotations

import os

LANGUAGES = ("en", "zh")
ENV_VAR = "DOJO_LANG"


def current() -> str:
    chosen = (os.environ.get(ENV_VAR) or "").strip().lower()
    if chosen:
        return "zh" if chosen.startswith("zh") else "en"
    for name in ("LC_ALL", "LC_MESSAGES", "LANG"):
        value = os.environ.get(name)
        if value:
            return "zh" if value.lower().startswith("zh") else "en"
    return "en"


def t(key: str, lang: str | None = None, **values: object) -> str:
    """The sentence ``key`` in the learner's language, with ``values`` filled in."""
    both = MESSAGES[key]
    return both[lang or current()].format(**values)


MESSAGES: dict[str, dict[str, str]] = {
    "katas done": {"en": "{done} of {total} katas done", "zh": "已完成 {done}/{total} 个练习"},
    "status done": {"en": "done", "zh": "已完成"},
    "status current": {"en": "current", "zh": "当前"},
    "status pending": {"en": "pending", "zh": "待完成"},
    "status later": {"en": "later", "zh": "编写中"},
    "not written yet": {"en": "(not written yet)", "zh": "（尚未编写）"},
    "passes, next moves on": {
        "en": "(passes: `{next}` moves on)",
        "zh": "（已通过：`{next}` 进入下一个）",
    },
    "testing": {"en": ": testing {file} with {tests}", "zh": "：用 {tests} 测试 {file}"},
    "passes unchanged": {
        "en": "{kata} passes (nothing changed since it did).",
        "zh": "{kata} 已通过（此后没有改动）。",
    },
    "next: write": {
        "en": "Next: open {file}, read its lesson (the docstring at the top, or `{lesson}`) and write {step}.",
        "zh": "下一步：打开 {file}，读课文（文件开头的文档字符串，或 `{lesson}`），然后写{step}。",
    },
    "the first failing step": {"en": "the first failing step", "zh": "第一个未通过的步骤"},
    "hint and watch": {
        "en": "      `{hint}` gives a nudge; `{watch}` re-runs the tests every time you save.",
        "zh": "      `{hint}` 给出提示；`{watch}` 在每次保存后重新运行测试。",
    },
    "activate": {
        "en": "      (`source {activate}` once per shell, and plain `dojo` works too.)",
        "zh": "      （每个终端执行一次 `source {activate}`，之后直接用 `dojo` 即可。）",
    },
    "next moves on": {
        "en": "Next: `{next}` moves on to {kata}.",
        "zh": "下一步：`{next}` 进入 {kata}。",
    },
    "all written pass": {
        "en": "Every kata written so far passes; {later} are still being written.",
        "zh": "已编写的练习全部通过；{later} 还在编写中。",
    },
    "all pass": {
        "en": "Every kata passes: you have finished torch-dist-katas.",
        "zh": "全部练习通过：你已完成 torch-dist-katas。",
    },
    "hint gives a nudge": {"en": "`{hint}` gives a nudge.", "zh": "`{hint}` 给出提示。"},
    "stay": {
        "en": "{kata} does not pass yet, so you stay on it. `{hint}` helps; `{goto}` jumps elsewhere on purpose.",
        "zh": "{kata} 还没有通过，所以继续做它。`{hint}` 可以帮忙；`{goto}` 可以有意跳到别的练习。",
    },
    "done, now": {"en": "{kata} done. Now: {upcoming}", "zh": "{kata} 完成。现在：{upcoming}"},
    "open and read": {
        "en": "Open {file} and read its lesson (`{lesson}`); `{dojo}` runs its tests.",
        "zh": "打开 {file} 读它的课文（`{lesson}`）；`{dojo}` 运行它的测试。",
    },
    "step": {"en": "step {number} · {title}", "zh": "第 {number} 步 · {title}"},
    "step bare": {"en": "step {number}", "zh": "第 {number} 步"},
    "passes all": {
        "en": "{kata} passes: all {count} tests{skipped} in {seconds} s.",
        "zh": "{kata} 通过：全部 {count} 个测试{skipped}，用时 {seconds} 秒。",
    },
    "skipped": {"en": " ({count} skipped)", "zh": "（跳过 {count} 个）"},
    "n of m pass": {
        "en": "{kata}: {passed} of {total} tests pass{skipped}",
        "zh": "{kata}：{total} 个测试中通过 {passed} 个{skipped}",
    },
    "full stop": {"en": ".", "zh": "。"},  # a Chinese sentence ends with its own full stop
    "first failing step": {
        "en": ". First failing step: {step}",
        "zh": "。第一个未通过的步骤：{step}",
    },
    "not implemented header": {"en": "not implemented yet:", "zh": "尚未实现："},
    "todo also": {"en": " (also: {whats})", "zh": "（还有：{whats}）"},
    "todo counted": {"en": "  {step}: {counted}", "zh": "  {step}：{counted}"},
    "tests counted": {"en": "{count} test", "zh": "{count} 个测试"},
    "tests counted plural": {"en": "{count} tests", "zh": "{count} 个测试"},
    "the same error": {"en": "the same error", "zh": "同样的错误"},
    "and more": {"en": " and {count} more", "zh": " 等 {count} 个"},
    "more errors": {
        "en": "... and more failing tests with other errors",
        "zh": "……还有其他测试失败，错误各不相同",
    },
    "your code": {"en": "your code: {place}", "zh": "你的代码：{place}"},
    "on rank": {"en": " (rank {rank})", "zh": "（rank {rank}）"},
    "uses earlier code": {
        "en": "({kata}'s tests use {other}'s code: write that step first)",
        "zh": "（{kata} 的测试用到 {other} 的代码：先写完那一步）",
    },
    "could not start": {
        "en": "; {count} could not start (the error above: does {file} import?)",
        "zh": "；{count} 个无法开始（见上面的错误：{file} 能导入吗？）",
    },
    "no tests": {
        "en": "{kata}: pytest found no tests in {file}.",
        "zh": "{kata}：pytest 在 {file} 中没有找到测试。",
    },
    "stopped at deadlock": {
        "en": "Stopped at that deadlock: the {count} test(s) after it did not run (most would wait "
        "for the same one). Fix it, then run the tests again.",
        "zh": "在这个死锁处停止：其后的 {count} 个测试没有运行（大多会卡在同一处）。修好它，再运行测试。",
    },
    "interrupted in": {"en": "Ctrl-C stopped {test}:", "zh": "Ctrl-C 停止了 {test}："},
    "interrupted": {
        "en": "Interrupted after {seconds} s: {count} test(s) had finished ({passed} passed, "
        "{failed} failed) and the others did not run, so {kata} does not pass yet.",
        "zh": "已中断（{seconds} 秒）：{count} 个测试已完成（通过 {passed} 个，失败 {failed} 个），"
        "其余没有运行，所以 {kata} 还没有通过。",
    },
    "unchanged since": {
        "en": "(the outcome of its last run, at {at}: nothing has changed since; `{check}` runs the tests again)",
        "zh": "（上次运行的结果，{at}：此后没有改动；`{check}` 重新运行测试）",
    },
    "every failure in full": {
        "en": "(every failure in full: {command})",
        "zh": "（查看全部失败详情：{command}）",
    },
    "hint header": {
        "en": ": hint {level} of {tiers} ({why})",
        "zh": "：提示 {level}/{tiers}（{why}）",
    },
    "why first failing": {"en": "the first failing step", "zh": "第一个未通过的步骤"},
    "why asked": {"en": "the step asked for", "zh": "所指定的步骤"},
    "why passes": {"en": "it passes, so step 1", "zh": "已通过，所以显示第 1 步"},
    "why unknown": {
        "en": "no step could be told apart, so step 1",
        "zh": "无法判断是哪一步，所以显示第 1 步",
    },
    "stuck still": {
        "en": "Stuck still? {again} shows hint {next} of {tiers} (it says more of the answer).",
        "zh": "还是卡住了？{again} 显示提示 {next}/{tiers}（会透露更多答案）。",
    },
    "last hint": {
        "en": "That was the last hint for this step; `{solution}` compares with the reference.",
        "zh": "这是本步骤的最后一条提示；`{solution}` 可与参考答案比较。",
    },
    "todo": {"en": "{todo}", "zh": "尚未实现：{kata} 第 {step} 步（{title}）"},
    "todo write": {
        "en": "  -> write step {step} in {file} (its lesson explains it)",
        "zh": "  -> 在 {file} 中写第 {step} 步（课文里有讲解）",
    },
    "todo hint": {"en": "  hint: {hint}  (more: {more})", "zh": "  提示：{hint}（更多：{more}）"},
    "no lesson": {
        "en": "{kata} has no lesson in this language yet.",
        "zh": "{kata} 还没有中文课文。",
    },
}

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci_last = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    blocks = readme.split("```bash\n")
    assert blocks[2].split("\n")[0] == ci_last, "README's second command must be .ci/run's test command"

"""The documentation holds to the code: the site builds in strict mode (no broken link or anchor), the generated
references are what the code gives now, the troubleshooting page names every error class with its exit code, and
the README's links lead somewhere."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

from trainyard import errors

ROOT = Path(__file__).resolve().parents[2]


def _gen():
    """docs/gen.py, imported from its file: it lives beside the pages it writes, outside the package."""
    spec = importlib.util.spec_from_file_location("docs_gen", ROOT / "docs" / "gen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    """Not `-q`: mkdocs counts only the warnings it logs, so a quiet strict build passes a broken link."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()


def test_the_generated_references_are_what_the_code_gives() -> None:
    gen = _gen()
    for path, make in gen.PAGES.items():
        assert path.read_text() == make(), f"{path.relative_to(ROOT)} is out of date: run `{gen.REGENERATE}`"


def test_the_config_reference_names_every_field_with_its_default_and_docstring() -> None:
    from trainyard.config import JobConfig

    page = (ROOT / "docs" / "reference" / "config.md").read_text()
    for section, field in JobConfig.model_fields.items():
        if hasattr(field.annotation, "model_fields"):
            for name in field.annotation.model_fields:
                assert f"### `{section}.{name}`" in page, f"{section}.{name}"
    dtype = page.split("### `model.dtype`")[1].split("###")[0]
    assert "**default** `auto`" in dtype and "`bfloat16`" in dtype and "How frozen base weights are stored" in dtype
    assert "**default** `builtin:smollm2-135m-instruct`" in page.split("### `model.path`")[1].split("###")[0]


def _error_classes() -> list[type[errors.TrainyardError]]:
    return [cls for cls in vars(errors).values()
            if isinstance(cls, type) and issubclass(cls, errors.TrainyardError) and cls is not errors.TrainyardError]


def test_troubleshooting_names_every_error_class_with_its_exit_code() -> None:
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    for cls in _error_classes():
        row = re.search(rf"^\| `{cls.__name__}` \| (\d+) \|", page, re.MULTILINE)
        assert row, f"docs/troubleshooting.md has no row for {cls.__name__}"
        assert int(row.group(1)) == cls.exit_code, f"{cls.__name__} exits {cls.exit_code}, the page says {row[1]}"
    for code in sorted({cls.exit_code for cls in _error_classes()} | {0}):
        assert re.search(rf"^\| {code} \|", page, re.MULTILINE), f"exit code {code} has no row"


def test_the_readme_links_lead_to_files_that_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert links
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, missing

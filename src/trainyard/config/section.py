"""What every section of the job schema shares: no unknown keys, checked on assignment, aliases by name; and how
a check names a field with the file:line that set it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationInfo


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


def field_and_where(info: ValidationInfo, field: str) -> str:
    """`field (file:line)` when the loader passed, as validation context, where each field was set."""
    where = (info.context or {}).get("where")
    return f"{field} ({where(field)})" if where else field

"""`python -m prorl.verl_compat > docs/verl.md`: the key table."""

from prorl.verl_compat import reference_markdown

print(reference_markdown(), end="")

"""Tasks (imported explicitly: fairseq only auto-imports a user directory's ``tasks/``
when it is given by path)."""
from . import translation_gnmt  # noqa: F401
from . import multi_source_translation  # noqa: F401

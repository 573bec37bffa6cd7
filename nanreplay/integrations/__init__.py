"""Optional integrations with training frameworks. Each lives in its own module and imports its
framework only when that module is imported: ``import nanreplay`` imports none of them."""

"""The operator API (SPEC 17): what a person does on the dashboard, for automation with an
operator token. Thin views over the same services and selectors as the pages (api.py)."""

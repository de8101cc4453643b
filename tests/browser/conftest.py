"""The browser tests' expectations wait as long as their pages' actions do (10 s,
`page.set_default_timeout`), not Playwright's 5 s: in CI both stacks' suites run side by side
and a swap under that load came later than 5 s (an expectation, not a timing)."""

from playwright.sync_api import expect

expect.set_options(timeout=10_000)

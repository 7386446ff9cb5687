"""The check that a run's components are its phases (tests/test_components.py and the engine suite)."""

SCOPE_MS = 0.01      # a scope's stamps sit a few µs outside its phase timers (clock reads, the timers' enter/leave)


def adds_up(res: dict) -> None:
    """Every bucket's components sum to the phase as the recorder timed the same steps: within 5 %, plus 10 µs
    for each of the phase's scopes."""
    for key, b in res["components"].items():
        for ph, parts in b["components"].items():
            measured = b["measured"][ph]
            assert abs(sum(parts.values()) - measured) <= 0.05 * measured + SCOPE_MS * b["scopes"][ph], \
                (key, ph, parts, measured)

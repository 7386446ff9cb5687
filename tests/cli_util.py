"""Running the `specscope` CLI in-process from tests."""

from specscope.cli import main


def cli(capsys, *args):
    """(exit code, stdout, stderr) of `specscope ARGS...`."""
    capsys.readouterr()  # drop whatever setup printed (progress bars of save_pretrained)
    code = 0
    try:
        main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(code, err):
    """A user error: exit 2 and exactly one `error: ...` line, no traceback. Returns that line."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Traceback" not in err
    return lines[0]

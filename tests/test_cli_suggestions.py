"""A key the recipe does not accept is refused in one line that names where the setting lives instead."""

from __future__ import annotations

import pytest

from lightning_opt.recipes import gpt2, spd


@pytest.mark.parametrize(("main", "args", "named"), [
    (spd.main, ["--config", "spd_tms_5-2", "--model.train.lr", "0.01"], "use --model.optim.lr"),
    (spd.main, ["--config", "spd_tms_5-2", "--model.train.weight_decay", "0.1"], "use --model.optim.weight_decay"),
    (spd.main, ["--config", "spd_tms_5-2", "--model.train.compile", "true"], "use --model.compile"),
    (gpt2.main, ["--config", "gpt2/demo", "--model.compile_options", "{mode: max-autotune}"],
     "use --model.compile.options"),
])
def test_a_refused_key_names_where_the_setting_lives(main, args, named, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and named in err[0], err


def test_a_key_with_no_namesake_gets_the_parser_reason_alone(capsys) -> None:
    with pytest.raises(SystemExit):
        gpt2.main(["--config", "gpt2/demo", "--trainer.max_stepz", "1"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: unrecognized arguments: --trainer.max_stepz") and "; use" not in line

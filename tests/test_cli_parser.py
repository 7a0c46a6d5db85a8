"""The other commands' argument errors in one line, with the trainer's did-you-mean (fasttrain/cli_parser.py).

Before: argparse's whole usage block, then the error, and no suggestion for a near miss."""

import pytest

from fasttrain.data.__main__ import main as data_main
from fasttrain.selfcheck import main as selfcheck_main
from fasttrain.tf.convert import main as convert_main


@pytest.mark.parametrize(
    "main, argv, line",
    [
        (
            data_main,
            ["verify", ".", "--Workers", "2"],
            "python -m fasttrain.data: error: unrecognized arguments: --Workers 2; did you mean --workers? "
            "(--help lists the arguments)",
        ),
        (
            data_main,
            ["build", "--output_directory=x", "--train_shardz=4"],
            "python -m fasttrain.data: error: unrecognized arguments: --train_shardz=4; did you mean "
            "--train_shards? (--help lists the arguments)",
        ),
        (
            selfcheck_main,
            ["--outt", "x"],
            "fasttrain selfcheck: error: unrecognized arguments: --outt x; did you mean --out? "
            "(--help lists the arguments)",
        ),
        (
            convert_main,
            ["to-tf"],
            "python -m fasttrain.tf.convert to-tf: error: the following arguments are required: source, "
            "--out (--help lists the arguments)",
        ),
        (data_main, ["verify", ".", "--frobnicate"], "unrecognized arguments: --frobnicate (--help lists"),
    ],
)
def test_an_argument_error_is_one_line_with_the_closest_option(main, argv, line, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and line in err and "usage:" not in err, err

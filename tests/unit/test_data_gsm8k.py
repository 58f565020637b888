"""GSM8K loading: answer extraction, record validation with file:line errors, skip mode, hub wrapping."""

from __future__ import annotations

import json
import logging

import datasets
import pytest

from posttrain.core.config import DataConfig
from posttrain.core.errors import DataError
from posttrain.core.gsm8k import RECORD_FIELDS, count_ops, extract_final_answer
from posttrain.core.parsing import normalize_number
from posttrain.core.prompts import format_sft_target
from posttrain.data.sources import load_hub, load_jsonl, load_records

GOOD = {"question": "Tom has 2 apples and buys 3 more. How many?", "answer": "2+3 = <<2+3=5>>5\n#### 5"}


def write_jsonl(path, lines):
    """Write raw lines (dicts are JSON-encoded, strings written verbatim)."""
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines))
    return path


@pytest.mark.parametrize(
    ("solution", "expected"),
    [
        ("She sold 48/2 = <<48/2=24>>24.\n#### 72", "72"),  # the ordinary case
        ("#### 1,234", "1234"),  # thousands separator
        ("#### 109,200,000", "109200000"),  # several groups (real GSM8K gold)
        ("#### $5", "5"),  # currency sign
        ("#### -3", "-3"),  # negative (3 GSM8K train golds are)
        ("#### 2.50", "2.5"),  # decimals in canonical form
        ("#### 0.5", "0.5"),  # leading zero kept
        ("#### 42  \n", "42"),  # trailing whitespace / newline
        ("x #### 1\ny #### 7", "7"),  # the LAST #### wins
    ],
)
def test_extract_final_answer(solution, expected):
    assert extract_final_answer(solution) == expected


@pytest.mark.parametrize(
    ("solution", "message"),
    [
        ("no final line at all", "has no '#### <number>'"),  # missing marker
        ("####", "is not a number"),  # empty after the marker
        ("#### seventy", "'seventy' after '####' is not a number"),  # words
        ("#### 3,4", "is not a number"),  # malformed thousands group
    ],
)
def test_extract_final_answer_rejects(solution, message):
    with pytest.raises(DataError, match=message):
        extract_final_answer(solution)


def test_data_error_is_value_error():
    assert issubclass(DataError, ValueError)


def test_count_ops():
    assert count_ops("a <<1+1=2>>2 b <<2*3=6>>6\n#### 6") == 2
    assert count_ops("no annotations\n#### 1") == 0


def test_load_jsonl_records_and_ids(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [GOOD, "", {**GOOD, "answer": "#### 1,000"}])
    result = load_jsonl(path)
    assert [r["id"] for r in result.records] == ["train-00001", "train-00003"]  # blank line 2 skipped
    first = result.records[0]
    assert tuple(first) == RECORD_FIELDS
    assert first == {
        "id": "train-00001",
        "question": GOOD["question"],
        "solution": GOOD["answer"],
        "answer": "5",
        "ops": 1,
        "source": "train.jsonl",
    }
    assert result.records[1]["answer"] == "1000"
    assert result.skipped == []


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"question": "q", "answer": ', "malformed JSON"),  # truncated line
        ('["question", "answer"]', "expected a JSON object, got list"),  # not an object
        ({"question": "q"}, "missing field 'answer'"),  # missing field
        ({"answer": "#### 1"}, "missing field 'question'"),  # missing field
        ({"question": 7, "answer": "#### 1"}, "field 'question' must be a string, got int"),  # wrong type
        ({"question": "q", "answer": None}, "field 'answer' must be a string, got NoneType"),  # null
        ({"question": "  ", "answer": "#### 1"}, "field 'question' is empty"),  # blank question
        ({"question": "q", "answer": "it is 5"}, "answer has no '#### <number>' final line"),  # no marker
        ({"question": "q", "answer": "#### five"}, "'five' after '####' is not a number"),  # non-numeric
    ],
)
def test_load_jsonl_bad_record_names_file_and_line(tmp_path, bad_line, message):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD, "", bad_line, GOOD])  # bad record on line 3
    with pytest.raises(DataError) as info:
        load_jsonl(path)
    assert str(info.value).startswith(f"{path}:3: ")
    assert message in str(info.value)


def test_load_jsonl_skip_mode_counts_and_warns_once(tmp_path, caplog):
    path = write_jsonl(
        tmp_path / "data.jsonl",
        [GOOD, "{oops", GOOD, {"question": "q", "answer": "#### x"}, GOOD, {"question": "q"}],
    )
    with caplog.at_level(logging.WARNING, logger="posttrain.data.sources"):
        result = load_jsonl(path, on_bad_record="skip")
    assert len(result.records) == 3
    assert [(f, line) for f, line, _ in result.skipped] == [(str(path), 2), (str(path), 4), (str(path), 6)]
    assert "malformed JSON" in result.skipped[0][2]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "skipped 3 bad record(s)" in warnings[0].getMessage()


def test_load_jsonl_folder_sorted_and_limit(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", [GOOD, GOOD])
    write_jsonl(tmp_path / "a.jsonl", [GOOD, GOOD])
    (tmp_path / "notes.txt").write_text("ignored")
    result = load_jsonl(tmp_path)
    assert [r["id"] for r in result.records] == ["a-00001", "a-00002", "b-00001", "b-00002"]
    assert [r["source"] for r in result.records] == ["a.jsonl"] * 2 + ["b.jsonl"] * 2
    assert [r["id"] for r in load_jsonl(tmp_path, limit=3).records] == ["a-00001", "a-00002", "b-00001"]


def test_load_jsonl_limit_counts_valid_records_only(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["not json", GOOD, GOOD, "also bad"])
    result = load_jsonl(path, on_bad_record="skip", limit=2)
    assert [r["id"] for r in result.records] == ["d-00002", "d-00003"]
    assert len(result.skipped) == 1  # stopped before reading line 4


@pytest.mark.parametrize(
    ("make_path", "message"),
    [
        (lambda tmp: tmp / "missing.jsonl", "no such file or folder"),  # absent file
        (lambda tmp: tmp, r"folder contains no \*\.jsonl files"),  # empty folder
    ],
)
def test_load_jsonl_missing_inputs(tmp_path, make_path, message):
    with pytest.raises(DataError, match=message):
        load_jsonl(make_path(tmp_path))


def test_load_jsonl_rejects_unknown_mode(tmp_path):
    with pytest.raises(ValueError, match="on_bad_record"):
        load_jsonl(write_jsonl(tmp_path / "x.jsonl", [GOOD]), on_bad_record="ignore")


def test_real_gsm8k_train_every_line_parses(gsm8k_train_path):
    result = load_jsonl(gsm8k_train_path)
    assert len(result.records) == 7473
    assert result.skipped == []
    assert len({r["id"] for r in result.records}) == 7473
    for record in result.records:
        assert normalize_number(record["answer"]) == record["answer"]  # canonical
        target = format_sft_target(record["solution"])
        assert "<<" not in target and target.endswith(f"<answer>\n{record['answer']}\n</answer>")
    assert sum(r["ops"] for r in result.records) == 23716  # every <<...>> annotation counted


def _fake_hub(rows):
    def load_dataset(path, name=None, split=None, **kwargs):
        assert (path, name, split) == ("openai/gsm8k", "main", "train")
        return datasets.Dataset.from_list(rows)

    return load_dataset


def test_load_hub_ids_and_limit(monkeypatch):
    monkeypatch.setattr(datasets, "load_dataset", _fake_hub([GOOD, GOOD, GOOD]))
    result = load_hub("openai/gsm8k", "main", "train", limit=2)
    assert [r["id"] for r in result.records] == ["gsm8k-train-00000", "gsm8k-train-00001"]
    assert result.records[0]["source"] == "openai/gsm8k"


def test_load_hub_bad_row_names_split_and_row(monkeypatch):
    monkeypatch.setattr(datasets, "load_dataset", _fake_hub([GOOD, {"question": "q", "answer": "none"}]))
    with pytest.raises(DataError, match=r"^openai/gsm8k\[train\]:1: answer has no"):
        load_hub()


def test_load_hub_unreachable_suggests_offline_sources(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError) as info:
        load_hub()
    message = str(info.value)
    assert "unreachable" in message and "data.source: local" in message and "synthetic" in message
    assert isinstance(info.value.__cause__, ConnectionError)


def test_load_records_dispatch(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "t.jsonl", [GOOD] * 5)
    assert len(load_records(DataConfig(source="local", path=str(path), limit=3))) == 3
    synthetic = load_records(DataConfig(source="synthetic", limit=7))
    assert len(synthetic) == 7 and synthetic.records[0]["id"] == "synthetic-s0-0"
    farm = load_records(DataConfig(source="synthetic", limit=5, synthetic={"themes": ["farm"]}))
    assert all(r["id"].startswith("synthetic-farm-") and "apple" in r["question"] for r in farm.records)
    monkeypatch.setattr(datasets, "load_dataset", _fake_hub([GOOD] * 4))
    assert len(load_records(DataConfig(source="hub", limit=2))) == 2


def test_a_blank_question_is_named_exactly():
    from posttrain.core.gsm8k import make_record

    with pytest.raises(DataError) as error:
        make_record({"question": " ", "answer": "#### 1"}, record_id="r", source="s")
    assert str(error.value) == "field 'question' is empty"


# `posttrain data fetch gsm8k`: the hub split saved as a local file, with the loader stubbed (no network).


def _fake_split(rows, split):
    def load_dataset(path, name=None, split=None, **kwargs):
        assert (path, name) == ("openai/gsm8k", "main")
        assert split == want
        return datasets.Dataset.from_list(rows)

    want = split
    return load_dataset


@pytest.mark.parametrize("split", ["train", "test"])
def test_data_fetch_writes_a_local_file_a_run_reads(tmp_path, monkeypatch, capsys, split):
    from posttrain.cli import main

    rows = [GOOD, {"question": "What is 6 times 7?", "answer": "6*7 = <<6*7=42>>42\n#### 42"}]
    monkeypatch.setattr(datasets, "load_dataset", _fake_split(rows, split))
    output = tmp_path / "gsm8k" / f"{split}.jsonl"
    assert main(["data", "fetch", "gsm8k", "--split", split, "--output", str(output)]) == 0
    assert [json.loads(line) for line in output.read_text().splitlines()] == rows
    loaded = load_records(DataConfig(source="local", path=str(output)))
    assert [r["answer"] for r in loaded.records] == ["5", "42"]
    assert "wrote 2 records" in capsys.readouterr().out
    assert [p.name for p in output.parent.iterdir()] == [output.name]  # no temporary file left


@pytest.mark.parametrize(
    ("rows", "exists", "fragment"),
    [
        pytest.param(
            [GOOD, {"question": "q", "answer": "none"}],
            False,
            "openai/gsm8k[train]:1: answer has no",
            id="bad answer",
        ),
        pytest.param(
            [GOOD, {"question": "q"}], False, "[train]:1: field 'answer' must be a string", id="no answer"
        ),
        pytest.param([], False, "openai/gsm8k[train]: the split has no rows", id="empty split"),
        pytest.param([GOOD], True, "already exists; pass --force to replace it", id="file exists"),
        pytest.param(
            ConnectionError("Couldn't reach the Hub"), False, "posttrain data fetch", id="hub unreachable"
        ),
    ],
)
def test_data_fetch_failures_are_one_line_and_write_nothing(
    tmp_path, monkeypatch, capsys, rows, exists, fragment
):
    from posttrain.cli import main

    if isinstance(rows, Exception):

        def unreachable(*args, **kwargs):
            raise rows

        monkeypatch.setattr(datasets, "load_dataset", unreachable)
    else:
        monkeypatch.setattr(datasets, "load_dataset", _fake_split(rows, "train"))
    output = tmp_path / "train.jsonl"
    if exists:
        output.write_text("earlier\n")
    assert main(["data", "fetch", "gsm8k", "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err
    assert (output.read_text() == "earlier\n") if exists else not output.exists()
    assert [p.name for p in tmp_path.iterdir()] == (["train.jsonl"] if exists else [])


def test_data_fetch_force_replaces_a_file(tmp_path, monkeypatch):
    from posttrain.cli import main

    monkeypatch.setattr(datasets, "load_dataset", _fake_split([GOOD], "train"))
    output = tmp_path / "train.jsonl"
    output.write_text("earlier\n")
    assert main(["data", "fetch", "gsm8k", "--output", str(output), "--force"]) == 0
    assert json.loads(output.read_text()) == GOOD


def test_data_fetch_saves_both_splits_in_the_clone_and_keeps_those_there(tmp_path, monkeypatch, capsys):
    from posttrain.cli import main

    splits = {"train": [GOOD], "test": [{"question": "What is 6 times 7?", "answer": "#### 42"}]}
    asked = []

    def load_dataset(path, name=None, split=None, **kwargs):
        asked.append(split)
        return datasets.Dataset.from_list(splits[split])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GSM8K_DIR", raising=False)
    assert main(["data", "fetch", "gsm8k"]) == 0
    folder = tmp_path / "data" / "gsm8k"
    assert sorted(p.name for p in folder.iterdir()) == ["test.jsonl", "train.jsonl"]
    assert [json.loads(line) for line in (folder / "test.jsonl").read_text().splitlines()] == splits["test"]
    assert asked == ["train", "test"]
    assert main(["data", "fetch", "gsm8k"]) == 0  # both there: the hub is not asked again
    assert asked == ["train", "test"]
    assert "data/gsm8k/test.jsonl: already there" in capsys.readouterr().out

    monkeypatch.setenv("GSM8K_DIR", str(tmp_path / "elsewhere"))
    assert main(["data", "fetch", "gsm8k", "--split", "test"]) == 0
    assert [p.name for p in (tmp_path / "elsewhere").iterdir()] == ["test.jsonl"]
    assert main(["data", "fetch", "gsm8k", "--dir", "third"]) == 0  # --dir over $GSM8K_DIR
    assert sorted(p.name for p in (tmp_path / "third").iterdir()) == ["test.jsonl", "train.jsonl"]


def test_hold_out_makes_a_test_file_no_training_line_shares(tmp_path, capsys):
    from posttrain.cli import main

    rows = [{"question": f"What is {i} plus 1?", "answer": f"#### {i + 1}"} for i in range(10)]
    source = tmp_path / "all.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    train, test = tmp_path / "gsm8k" / "train.jsonl", tmp_path / "gsm8k" / "test.jsonl"
    args = ["data", "hold-out", str(source), "--last", "3", "--train", str(train), "--test", str(test)]
    assert main(args) == 0
    assert [json.loads(line) for line in train.read_text().splitlines()] == rows[:7]
    assert [json.loads(line) for line in test.read_text().splitlines()] == rows[7:]
    assert "wrote 7 records" in capsys.readouterr().out
    assert main(args) == 2  # files that exist are kept unless --force
    assert "already exists; pass --force" in capsys.readouterr().err
    assert main([*args, "--force"]) == 0


LINE = '{"question": "q?", "answer": "#### 1"}\n'


@pytest.mark.parametrize(
    ("content", "last", "train", "test", "fragment"),
    [
        (
            LINE + '{"question": "q?"}\n',
            1,
            "train.jsonl",
            "test.jsonl",
            "all.jsonl:2: missing field 'answer'",
        ),
        (LINE, 1, "train.jsonl", "test.jsonl", "1 records; --last 1 would leave none to train on"),
        (LINE * 3, 1, "all.jsonl", "test.jsonl", "write the two parts to other files"),
        (LINE * 3, 0, "train.jsonl", "test.jsonl", "--last must be >= 1"),
        (LINE * 3, 1, "part.jsonl", "part.jsonl", "--train and --test name one file"),  # the test part won
        (LINE * 3, 1, "train.jsonl", "out/", "out is a folder, not a file"),
    ],
    ids=["bad line", "nothing left to train on", "in place", "zero", "one file for both", "a folder"],
)
def test_hold_out_refuses_bad_input_and_writes_nothing(
    tmp_path, capsys, content, last, train, test, fragment
):
    from posttrain.cli import main

    source = tmp_path / "all.jsonl"
    source.write_text(content)
    made = {"all.jsonl"}
    if test.endswith("/"):
        (tmp_path / test).mkdir()
        made.add(test.rstrip("/"))
    argv = ["data", "hold-out", str(source), "--last", str(last), "--train", str(tmp_path / train)]
    assert main([*argv, "--test", str(tmp_path / test), "--force"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err
    assert {p.name for p in tmp_path.iterdir()} == made and source.read_text() == content
    assert not any((tmp_path / name).is_dir() and any((tmp_path / name).iterdir()) for name in made)

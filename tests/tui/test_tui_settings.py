"""Settings, remembered state, theme files, number formats, and the reply buffer between threads."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from cmpchat.engine.events import ContentDelta, DecodeProgress, Finished, PromptProgress, ReasoningDelta, Timings
from cmpchat.tui import format as fmt
from cmpchat.tui.reply_run import SLOWEST_UPDATE, UI_SHARE, UpdatePacer
from cmpchat.tui.reply_stream import ReplyBuffer, run_generation
from cmpchat.tui.settings import AppState, ChatOptions, Settings, load_settings, load_state, save_state
from cmpchat.tui.themes import load_theme, load_themes, theme_folders

REPO = Path(__file__).resolve().parents[2]


def test_missing_settings_file_gives_defaults(tmp_path):
    settings, problems = load_settings(tmp_path / "config.toml")
    assert settings == Settings() and problems == []


def test_settings_are_read_and_mistakes_reported(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(
        'theme = "terminal"\nthinking = false\ntemperature = 1\nmax_tokens = "lots"\ncolour = "red"\n'
        'refresh_hz = 500\n[keymap]\n"chat.export" = "f9"\n'
    )
    settings, problems = load_settings(path)
    assert settings.theme == "terminal" and settings.thinking is False and settings.temperature == 1
    assert settings.max_tokens == Settings().max_tokens and settings.keymap == {"chat.export": "f9"}
    assert settings.refresh_hz == 60  # clamped
    assert len(problems) == 2 and any("colour" in p for p in problems) and any("max_tokens" in p for p in problems)


def test_broken_settings_file_is_reported_not_fatal(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("theme = ")
    settings, problems = load_settings(path)
    assert settings == Settings() and "default settings" in problems[0]


def test_every_setting_is_documented():
    source = (REPO / "cmpchat" / "tui" / "settings.py").read_text()
    body = source[source.index("class Settings") : source.index("def __post_init__")]
    for name in Settings.__dataclass_fields__:
        assert f"    {name}:" in body
        after = body[body.index(f"    {name}:") :].splitlines()[1].strip()
        assert after.startswith('"""'), f"{name} has no docstring"


def test_state_round_trips(tmp_path):
    path = tmp_path / "state.json"
    assert load_state(path) == AppState()
    save_state(AppState(last_model="", theme="terminal", thinking=False, last_chat=3), path)
    assert load_state(path) == AppState(last_model="", theme="terminal", thinking=False, last_chat=3)
    path.write_text("{not json")
    assert load_state(path) == AppState()


def test_chat_options_make_generation_options():
    options = ChatOptions(system_prompt="s", temperature=0.0, top_p=0.9, top_k=5, max_tokens=7, seed=3)
    generation = options.generation_options()
    assert generation.max_tokens == 7 and generation.sampling.seed == 3 and generation.sampling.is_greedy
    assert ChatOptions.from_dict(options.to_dict()) == options
    assert ChatOptions.from_dict({"temperature": 0.1, "unknown": 1}, ChatOptions(top_k=3)).top_k == 3
    with pytest.raises(ValueError):
        ChatOptions(top_p=2.0).generation_options()


def test_shipped_themes_load_from_the_top_level_folder():
    assert (REPO / "themes").resolve() in [folder.resolve() for folder in theme_folders()]
    themes, problems = load_themes([REPO / "themes"])
    assert problems == []
    names = {theme.name: theme for theme in themes}
    assert {"cmpchat-dark", "cmpchat-light", "terminal"} <= set(names)
    assert names["cmpchat-dark"].dark and not names["cmpchat-light"].dark and names["terminal"].ansi


def test_user_themes_override_and_bad_files_are_reported(tmp_path):
    (tmp_path / "mine.toml").write_text('primary = "#ff0000"\n')
    (tmp_path / "bad.toml").write_text('primary = "not a colour"\n')
    (tmp_path / "odd.toml").write_text('primary = "#fff"\nsparkle = true\n')
    themes, problems = load_themes([tmp_path])
    assert [t.name for t in themes] == ["mine"]
    assert len(problems) == 2 and any("sparkle" in p for p in problems)
    with pytest.raises(ValueError, match="primary"):
        (tmp_path / "empty.toml").write_text('name = "x"\n')
        load_theme(tmp_path / "empty.toml")


@pytest.mark.parametrize(
    ("function", "value", "text"),
    [
        (fmt.count, 18204, "18,204"),
        (fmt.short_count, 18204, "18K"),
        (fmt.short_count, 262144, "256K"),
        (fmt.short_count, 1536, "1.5K"),
        (fmt.short_count, 2**20, "1M"),
        (fmt.short_count, 512, "512"),
        (fmt.rate, 27.44, "27.4"),
        (fmt.rate, 812.0, "812"),
        (fmt.rate, 4096.0, "4,096"),
        (fmt.rate, None, "–"),
        (fmt.seconds, 1.4234, "1.42 s"),
        (fmt.seconds, 75, "1m15s"),
        (fmt.megabytes_per_second, 2.1 * 2**20, "2.1"),
        (fmt.file_size, 9 * 2**30, "9.0 GiB"),
    ],
)
def test_number_formats(function, value, text):
    assert function(value) == text


def test_sparkline_scales_and_pads():
    assert fmt.sparkline([0, 50, 100], 5, top=100) == "  ▁▅█"
    assert fmt.sparkline([], 3) == "   "
    assert fmt.sparkline([1, 2, 3, 4, 5, 6], 3) == "▆▇█"


def test_reply_buffer_merges_everything_since_the_last_drain():
    buffer = ReplyBuffer()
    assert buffer.drain() is None
    buffer.push(PromptProgress(10, 10, 100.0))
    buffer.push(ReasoningDelta("hm "))
    buffer.push(ContentDelta("Hel"))
    buffer.push(DecodeProgress(1, 20.0))
    buffer.push(ContentDelta("lo"))
    buffer.push(DecodeProgress(2, 21.0))
    update = buffer.drain()
    assert update is not None and update.decode is not None and update.prompt is not None
    assert update.reasoning == "hm " and update.content == "Hello" and update.decode.generated_tokens == 2
    assert update.prompt.done == 10 and update.first_token_seconds is not None and not update.done
    assert buffer.drain() is None
    timings = Timings(10, 0.1, 2, 2, 0.1, 0.05)
    buffer.push(Finished("stop", "Hello", "hm", (), timings))
    final = buffer.drain()
    assert final is not None and final.done


def test_run_generation_turns_a_crash_into_an_error_update():
    buffer = ReplyBuffer()

    def events():
        yield ContentDelta("a")
        raise RuntimeError("boom")

    run_generation(events, buffer, lambda err: f"failed: {err}")
    update = buffer.drain()
    assert update is not None and update.content == "a" and update.error == "failed: boom" and update.done


def test_reply_buffer_is_safe_across_threads():
    buffer = ReplyBuffer()
    texts: list[str] = []

    def produce():
        for i in range(2000):
            buffer.push(ContentDelta(str(i % 10)))

    thread = threading.Thread(target=produce)
    thread.start()
    while thread.is_alive():
        update = buffer.drain()
        if update:
            texts.append(update.content)
    thread.join()
    update = buffer.drain()
    if update:
        texts.append(update.content)
    assert "".join(texts) == "".join(str(i % 10) for i in range(2000))


def test_pacer_spaces_updates_by_the_cpu_they_cost(monkeypatch):
    clock = iter([0.0, 0.0005, 0.0305])
    monkeypatch.setattr("cmpchat.tui.reply_run.time.thread_time", lambda: next(clock))
    pacer = UpdatePacer(1 / 30)
    assert pacer.next_interval() == pytest.approx(1 / 30)  # cheap frame: the fastest rate
    assert pacer.next_interval() == pytest.approx(min(0.03 / UI_SHARE, SLOWEST_UPDATE))  # 30 ms frame: slower

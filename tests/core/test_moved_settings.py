"""A setting written with its old class (``c.GPUPool.idle_timeout``) is read
by its new one, with words; the new spelling wins where both are set."""

from traitlets import Integer, Unicode
from traitlets.config import Application, Config, Configurable

from gpupool.moved_settings import carry_moved, new_homes


class Workers(Configurable):
    warm = Integer(0).tag(config=True)


class Agent(Application):
    classes = [Workers]
    port = Integer(0).tag(config=True)
    name_ = Unicode("").tag(config=True)

    def update_config(self, config):
        carry_moved(config, "Agent", new_homes([Workers]), self.said.append)
        super().update_config(config)

    def __init__(self, **kw):
        self.said = []
        super().__init__(**kw)


def test_new_homes_names_every_setting_of_each_part():
    assert new_homes([Workers]) == {"warm": "Workers"}


def test_old_spelling_on_the_command_line_reaches_the_new_class():
    app = Agent()
    app.parse_command_line(["--Agent.warm=3", "--Agent.port=5"])
    assert Workers(parent=app).warm == 3
    assert app.port == 5  # a setting that stayed is left alone
    assert app.said == ["c.Agent.warm is now c.Workers.warm; the old spelling is read for now, please change it"]


def test_old_spelling_in_a_config_file_reaches_the_new_class(tmp_path):
    (tmp_path / "agent_config.py").write_text("c.Agent.warm = 2\n")
    app = Agent()
    app.load_config_file("agent_config.py", path=str(tmp_path))
    assert Workers(parent=app).warm == 2
    assert "warm" not in app.config.Agent


def test_the_new_spelling_wins_and_the_old_one_is_named_as_ignored():
    config = Config({"Agent": {"warm": 1}, "Workers": {"warm": 4}})
    said = []
    carry_moved(config, "Agent", new_homes([Workers]), said.append)
    assert config.Workers.warm == 4 and "warm" not in config.Agent
    assert said == ["c.Agent.warm is now c.Workers.warm, which is also set: c.Agent.warm is ignored"]


def test_nothing_to_move_changes_nothing():
    config = Config({"Other": {"warm": 1}})
    carry_moved(config, "Agent", new_homes([Workers]), [].append)
    assert config == Config({"Other": {"warm": 1}})

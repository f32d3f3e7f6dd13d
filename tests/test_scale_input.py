"""`rollout-cluster scale N` and RolloutClient.scale refuse a bad size before touching Ray,
naming the value (the e2e test tests/e2e/test_declarative_scaling.py scales a real fleet)."""
import pytest

from rollout_cluster.cli import main
from rollout_cluster.client.client import RolloutClient
from rollout_cluster.protocol import InputError


def test_cli_scale_refuses_a_size_below_one_before_connecting(capsys):
    assert main(["scale", "0", "--address", "ray://nowhere:1"]) == 2
    assert "replicas=0: must be an integer >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "2"])
def test_driver_scale_names_a_bad_size(bad):
    client = object.__new__(RolloutClient)  # no cluster: the check comes first
    with pytest.raises(InputError, match=r"^replicas=.*: must be an integer >= 1$"):
        client.scale(bad)

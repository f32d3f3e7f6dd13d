"""Security at three more edges (in-process, no Ray): secrets a local launcher finds planted in a
folder others may write are refused, a keys-file error never shows a secret, and an order signed
for one Serve app is refused by another app's router that shares the keys (the app is signed)."""
import asyncio
import os

import pytest

from rollout_cluster.config import ClusterConfig, SecurityConfig, to_dict
from rollout_cluster.security.local import ensure_local_secrets
from rollout_cluster.security.secrets import SecretError, read_keys
from rollout_cluster.security.signing import OrderRefused
from router_support import order

SECRET = "ab" * 32  # what `rollout-cluster secrets` / local.py make: 64 hex digits


# ---- local.py: secrets found (not made) in a folder others may write --------------------------------
@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_local_secrets_already_in_a_folder_others_may_write_are_refused_not_adopted(tmp_path, monkeypatch, mode):
    """check_private_dir refuses to *make* secrets in a folder another user could change ("they
    could swap the token for their own before the cluster reads it"), but files someone planted
    there beforehand are adopted as they are: the app then runs on a token and control keys that
    user knows (and can sign orders with)."""
    for var in ("ROLLOUT_TOKEN", "ROLLOUT_TOKEN_FILE", "ROLLOUT_CONTROL_KEYS", "ROLLOUT_CONTROL_KEYS_FILE"):
        monkeypatch.delenv(var, raising=False)
    folder = tmp_path / ".secrets"
    folder.mkdir()
    os.chmod(folder, mode)
    (folder / "token").write_text("planted-token-0123456789\n")
    (folder / "control-keys").write_text(f"planted {SECRET}\n")
    cfg = ClusterConfig(base_dir=str(tmp_path))
    with pytest.raises(PermissionError, match="writable by its group or others"):
        ensure_local_secrets(cfg)
    assert read_keys(cfg.security) != {"planted": SECRET.encode()}  # (were it adopted: the planter's key signs)


# ---- secrets.py: a keys-file error never shows the secret -----------------------------------------
def test_a_keys_line_with_its_columns_swapped_does_not_show_the_secret_in_the_error(tmp_path):
    """`secret key_id` instead of `key_id secret`: a hex secret matches KEY_ID, so the secret is
    taken for the key id and the 'must be at least 32 characters' error quotes it (the Router's
    and Gateway's start failure lands in Serve's logs and status)."""
    f = tmp_path / "keys"
    f.write_text(f"{SECRET} new\n")
    with pytest.raises(SecretError) as e:
        read_keys(SecurityConfig(control_keys_file=str(f)))
    assert SECRET not in str(e.value)


# ---- signing.py / serve/router.py: an order is bound to the app it was signed for ---------------------
def test_an_order_signed_for_one_app_is_refused_by_another_apps_router(tmp_path):
    """Two apps on one cluster that share the control keys (local launchers make one .secrets/ per
    config folder whatever the app_name; one k8s Secret), and each app's nonces journaled in its
    own namespace: an order a driver of app `one` signed (its signer binds the app, as every
    signer here does) is refused by app two's router, captured or sent to the wrong handle."""
    from rollout_cluster.security.signing import Signer
    from rollout_cluster.serve.router import Router

    signer_of_one = Signer(read_keys(SecurityConfig()), app="one")

    async def go():
        routers = [Router.func_or_class(to_dict(ClusterConfig(
            app_name=name, replicas=1, engine={"kind": "sim"}, security={"checkpoint_roots": [str(tmp_path)]})))
            for name in ("one", "two")]
        try:
            for_one = signer_of_one.sign("set_fleet_target", {"replicas": 3})  # signed by app one's driver
            assert await routers[0].set_fleet_target(for_one) == 3
            with pytest.raises(OrderRefused, match="wrong_app"):
                await routers[1].set_fleet_target(for_one)
            assert routers[1].core.fleet.expected == 1  # app two keeps its own fleet target
        finally:
            for r in routers:
                r._reaper.cancel()

    asyncio.run(go())


def test_an_orders_app_is_signed_so_it_cannot_be_stripped_or_changed():
    import dataclasses
    import time

    from rollout_cluster.security.signing import OrderVerifier, Signer

    keys = read_keys(SecurityConfig())
    good = Signer(keys, app="one").sign("wake", {})
    assert OrderVerifier(dict(keys), app="one").check(good, "wake", time.time()) == {}
    for app in ("", "two"):  # stripped (an app that takes unbound orders), or renamed to the target's
        forged = dataclasses.replace(good, app=app)  # (a fresh verifier each time: no replay)
        with pytest.raises(OrderRefused, match="bad_signature"):
            OrderVerifier(dict(keys), app="two" if app else "").check(forged, "wake", time.time())


def test_an_order_whose_app_is_no_string_is_refused_as_malformed_naming_app():
    import dataclasses
    import time

    from rollout_cluster.security.signing import OrderVerifier, Signer

    keys = read_keys(SecurityConfig())
    bad = dataclasses.replace(Signer(keys, app="one").sign("wake", {}), app=7)
    with pytest.raises(OrderRefused, match=r"malformed.*app=7"):
        OrderVerifier(dict(keys), app="one").check(bad, "wake", time.time())

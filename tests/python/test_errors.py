"""bindings/errors.cpp: Status codes become Python exceptions with the same message."""

import errno

import pytest

import tierzero
from tierzero import _core

EXPECTED = {
    "InvalidArgument": ValueError,
    "NotFound": FileNotFoundError,
    "AlreadyExists": FileExistsError,
    "OutOfMemory": MemoryError,
    "IoError": OSError,
    "DataCorruption": OSError,
    "NoSpace": OSError,
    "PermissionDenied": PermissionError,
    "Unavailable": RuntimeError,
    "FailedPrecondition": RuntimeError,
    "Timeout": TimeoutError,
    "Internal": RuntimeError,
}


def test_every_code_is_mapped():
    assert set(_core.ERROR_CODES) == set(EXPECTED)


@pytest.mark.parametrize("code,exc", sorted(EXPECTED.items()))
def test_code_maps_to_exception_with_the_same_message(code, exc):
    message = f"reading extent 7 of /nvme0/tz.swap at offset 4096: {code} happened"
    with pytest.raises(exc) as info:
        _core._raise_status(code, message)
    assert str(info.value) == message
    assert info.value.code == code
    assert type(info.value) is exc


def test_oserror_carries_errno():
    with pytest.raises(OSError) as info:
        _core._raise_status("IoError", "pwrite /x: Input/output error (errno 5)", errno.EIO)
    assert info.value.errno == errno.EIO
    assert str(info.value) == "pwrite /x: Input/output error (errno 5)"


def test_real_errors_name_what_failed(tmp_path):
    missing = tmp_path / "absent"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        tierzero.info(paths=[missing])
    with pytest.raises(ValueError, match="unknown_key"):
        tierzero.estimate(1e9, config={"zero_optimization": {"unknown_key": 1}})


def test_unknown_code_for_the_test_hook():
    with pytest.raises(ValueError, match="no error code named 'Nope'"):
        _core._raise_status("Nope", "x")

"""`tpud submit JOB.yaml` and `tpud cancel NAME`: job files in remote_jobs, the fleet's watched directory.

Every daemon whose tpud.yaml names the same `remote_jobs: gs://bucket/prefix/` runs what is there
(tpud/jobfiles/remote.py), so one submit starts a job on every host and one cancel stops it on
every host with a checkpoint. The object is `<prefix><job name>.yaml`. Both commands read the
object's generation first and write on the condition that it is still that one (GCS's
if_generation_match): of two operators racing, one wins and the other is told, nothing lost.

Submit validates the file as `tpud validate` does (FILE:LINE: KEY: MESSAGE, nothing uploaded on
an error). A file that includes others, or is given overrides, is uploaded as the job it makes,
its includes resolved: the hosts cannot read this machine's files.
"""

from __future__ import annotations

import argparse
import sys

from tpud.commands import EXIT_FAILED, EXIT_JOB_UNKNOWN, EXIT_OK

SUBMIT = ("Validate a job file as tpud validate does and upload it to remote_jobs (tpud.yaml's, or --to), "
          "the GCS directory every daemon of the fleet watches: each host starts the job within "
          "remote_jobs_poll_seconds; a job of that name already there is replaced and restarts everywhere. Nothing "
          "is uploaded when the file is invalid or the object changed since it was read (another operator). "
          "Exit 0 submitted (or unchanged), 1 invalid or refused.")
CANCEL = ("Remove job NAME's file from remote_jobs (tpud.yaml's, or --from): every host checkpoints the job and "
          "stops it. Exit 0 removed, 1 refused (the object changed since it was read, or GCS failed), 3 no such job "
          "file there.")


def add_submit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB.yaml", help="the job file")
    parser.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                        help="dotted overrides, value parsed as YAML; the job they make is what is uploaded")
    parser.add_argument("--to", metavar="gs://BUCKET/PREFIX/", help="the remote jobs directory (default: "
                        "tpud.yaml's remote_jobs)")


def add_cancel_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="the job's name (its file is NAME.yaml there)")
    parser.add_argument("--from", dest="source", metavar="gs://BUCKET/PREFIX/",
                        help="the remote jobs directory (default: tpud.yaml's remote_jobs)")


def submit(args: argparse.Namespace) -> int:
    from engine.spec.loader import SpecError, load_job

    try:
        loaded = load_job(args.job, args.overrides)
    except SpecError as e:
        print(e, file=sys.stderr)
        return EXIT_FAILED
    try:
        directory = _directory(args, args.to)
        text = _uploadable(args.job, loaded, bool(args.overrides))
        bucket, prefix = _bucket(directory)
        name = prefix + f"{loaded.spec.name}.yaml"
        blob = bucket.get_blob(name)
        if blob is not None and blob.size == len(text) and blob.download_as_bytes() == text:
            print(f"{_url(bucket, name)}: unchanged (generation {blob.generation})")
            return EXIT_OK
        target = bucket.blob(name)
        target.upload_from_string(text, content_type="application/yaml",
                                  if_generation_match=0 if blob is None else blob.generation)
    except _Refused as e:
        print(f"tpud submit: {e}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as e:  # noqa: BLE001 - GCS: a precondition lost, a bucket refused or unreachable
        print(f"tpud submit: {_gcs_error(e, directory, loaded.spec.name)}", file=sys.stderr)
        return EXIT_FAILED
    verb = "submitted" if blob is None else f"replaced generation {blob.generation}"
    print(f"{_url(bucket, name)}: {verb}, now generation {target.generation}: every daemon reading {directory} "
          f"runs job {loaded.spec.name}")
    return EXIT_OK


def cancel(args: argparse.Namespace) -> int:
    import re

    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]{0,62}", args.name):
        print(f"tpud cancel: {args.name!r} is no job name (lowercase letters, digits, . _ -)", file=sys.stderr)
        return EXIT_FAILED
    try:
        directory = _directory(args, args.source)
        bucket, prefix = _bucket(directory)
        blob = bucket.get_blob(prefix + f"{args.name}.yaml") or bucket.get_blob(prefix + f"{args.name}.yml")
        if blob is None:
            there = sorted(b.name[len(prefix):] for b in bucket.list_blobs(prefix=prefix, delimiter="/"))
            print(f"tpud cancel: no job file {args.name}.yaml in {directory}"
                  + (f" (it holds {', '.join(there[:10])})" if there else " (it is empty)"), file=sys.stderr)
            return EXIT_JOB_UNKNOWN
        blob.delete(if_generation_match=blob.generation)
    except _Refused as e:
        print(f"tpud cancel: {e}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as e:  # noqa: BLE001
        print(f"tpud cancel: {_gcs_error(e, directory, args.name)}", file=sys.stderr)
        return EXIT_FAILED
    print(f"{_url(bucket, blob.name)}: removed (it was generation {blob.generation}): every daemon reading "
          f"{directory} checkpoints and stops job {args.name}")
    return EXIT_OK


class _Refused(Exception):
    pass


def _directory(args: argparse.Namespace, given: str | None) -> str:
    """The remote jobs directory: the one given, else tpud.yaml's remote_jobs."""
    from tpud.paths import Paths
    from tpud.settings import load_settings

    if given:
        return given
    config = Paths.resolve(args.home).config
    settings, error = load_settings(config)
    if error:
        raise _Refused(f"{error}\n  (give the directory with --to/--from instead)")
    if settings.remote_jobs is None:
        raise _Refused(f"{config / 'tpud.yaml'} sets no remote_jobs: give the directory, e.g. --to gs://BUCKET/jobs/")
    return settings.remote_jobs


def _bucket(directory: str):
    """(the bucket, the object names' prefix) of a gs:// directory."""
    from tpud.gcs.tier import make_client
    from tpud.jobfiles.remote import split_url

    try:
        bucket, prefix = split_url(directory)
    except ValueError as e:
        raise _Refused(str(e)) from None
    return make_client().bucket(bucket), prefix


def _uploadable(path: str, loaded, overridden: bool) -> bytes:
    """The file's own bytes; the job it makes when it includes others or overrides apply."""
    from pathlib import Path

    import yaml

    own = Path(path).read_bytes()
    if not overridden and {origin.file for origin in loaded.origins.values()} <= {path}:
        return own
    document = loaded.spec.model_dump(mode="json", exclude_defaults=True)
    header = f"# {loaded.spec.name}: made by tpud submit from {path}, its includes and overrides applied\n"
    return (header + yaml.safe_dump(document, sort_keys=False)).encode()


def _url(bucket, name: str) -> str:
    return f"gs://{bucket.name}/{name}"


def _gcs_error(e: BaseException, directory: str, job: str) -> str:
    from google.api_core import exceptions

    if isinstance(e, exceptions.PreconditionFailed):
        return (f"{directory}: job {job}'s file changed since it was read (another operator?): nothing written; "
                "look at it and run the command again")
    return f"{directory}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

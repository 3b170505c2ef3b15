# syntax=docker/dockerfile:1
#
# weightcache: one image for every mode (docs/design.md §2): `weightcache fetch` as the init container
# of inference Pods, `weightcache daemon` as the node agent, `weightcache prefetch` as a Job.
#
#   docker build -t weightcache:0.1.0 .
#
# For a release, pin the base image by digest as well as by tag:
#   docker build --build-arg PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:<digest> .
# Both stages use the same base, so the virtualenv built in the first runs in the second.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# Behind a TLS-inspecting proxy, mount the host's CA bundle into the build and name it here
# (the official image's pip trusts only its vendored certifi bundle); build-time only:
#   podman build -v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro \
#       --build-arg PIP_CERT=/etc/ssl/certs/ca-certificates.crt .
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# The build backend (setuptools), hash-pinned; it stays in this stage.
COPY requirements-build.lock /tmp/requirements-build.lock
RUN pip install --no-cache-dir --require-hashes --only-binary=:all: \
        -r /tmp/requirements-build.lock

# Runtime dependencies, hash-pinned, into a virtualenv without pip. This layer stays cached
# until the lock changes. --require-hashes also rejects any dependency the lock forgot.
COPY requirements.lock /tmp/requirements.lock
RUN python -m venv --without-pip /opt/weightcache \
    && pip --python /opt/weightcache/bin/python install --no-cache-dir --require-hashes \
        --only-binary=:all: -r /tmp/requirements.lock

# The package itself: the same pyproject.toml and source tree that `pip install .` installs
# for the tests, built into a wheel here and installed without touching the pinned deps.
# With its extras `gcs` and `azure`, whose libraries the lock holds: one image reads every
# scheme (s3, file, http(s), hf, gs, az/abfs). `pip check` fails the build if the lock
# misses a dependency of anything installed; the import proves the scheme libraries load.
COPY pyproject.toml README.md /src/
COPY weightcache /src/weightcache
RUN pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /tmp/wheels /src \
    && pip --python /opt/weightcache/bin/python install --no-cache-dir --no-deps \
        "$(echo /tmp/wheels/weightcache-*.whl)[azure,gcs]" \
    && pip --python /opt/weightcache/bin/python check \
    && /opt/weightcache/bin/python -c "import adlfs, gcsfs" \
    && /opt/weightcache/bin/weightcache --help > /dev/null


FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="weightcache" \
      org.opencontainers.image.description="Idempotent model-weight fetcher and node-local cache daemon for Kubernetes GPU clusters" \
      org.opencontainers.image.licenses="Apache-2.0"

# A fixed, non-root uid/gid. The manifests run as 65532:65532 and the node's cache directory
# (/var/lib/weightcache) must be owned by it: see docs/deploy.md, "Prepare the GPU nodes".
RUN groupadd --system --gid 65532 weightcache \
    && useradd --system --no-log-init --uid 65532 --gid 65532 \
        --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin weightcache

COPY --from=build /opt/weightcache /opt/weightcache

# Bytecode was compiled at install time; the root filesystem is read-only at run time.
ENV PATH=/opt/weightcache/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

USER 65532:65532
ENTRYPOINT ["weightcache"]
CMD ["--help"]

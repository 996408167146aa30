# syntax=docker/dockerfile:1
# The oncely image: one image for every process (api, worker, relay, migrate).
#
#   docker build -t oncely .
#   docker run --rm oncely --version
#
# Stage 1 builds oncely's wheel and the wheels of everything it needs, so the
# final stage installs from local files only: no compilers, no build tools, no
# source tree. The embedded servers (the `embedded` extra) are not installed:
# a production process is given ONCELY_REDIS_URL and ONCELY_DATABASE_URL.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
# oncely's wheel, then the wheels of oncely[binary] (psycopg with its own
# libpq), resolved once here.
RUN pip wheel --no-deps --wheel-dir /wheels . \
    && pip wheel --wheel-dir /wheels "$(ls /wheels/oncely-*.whl)[binary]"

FROM ${PYTHON_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
# The wheels are mounted for the install only; they are not a layer of the image.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels "$(ls /wheels/oncely-*.whl)[binary]" \
    && groupadd --system --gid 10001 oncely \
    && useradd --system --uid 10001 --gid oncely --no-create-home --home-dir /app oncely
# Your own workflows (`--app module:attr`, ONCELY_APP) are importable from
# here: FROM this image, COPY them into /app.
WORKDIR /app
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["oncely"]
CMD ["api", "--host", "0.0.0.0"]

# SuperLink image: Flower's official flwr/superlink, pinned to the flwr the app is tested with.
# It only adds a state folder owned by the image's non-root user (uid 49999), so that a
# named volume mounted at /app/state (flower-superlink --database /app/state/state.db)
# is writable without any chown on the host.
ARG FLWR_VERSION=1.42.0
FROM flwr/superlink:${FLWR_VERSION}

ENV FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1

USER root
RUN mkdir -p /app/state && chown app:app /app/state
USER app
WORKDIR /app

ENTRYPOINT ["flower-superlink"]

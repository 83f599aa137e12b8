#!/usr/bin/env bash
# Builds Tether's OCI image without a registry or a container engine: a
# root file system of the project's binaries (from BIN_DIR) and the shared
# libraries they link (Debian's librocksdb among them, with the dynamic
# loader), the files deploy/Dockerfile's image has besides (a `tether`
# user 10001, CA certificates, /var/lib/tether), written as one
# uncompressed layer in an OCI image layout and tarred to OUT, with the
# image config of deploy/Dockerfile (user, working directory, volume,
# ports, command). Import it with `ctr -n k8s.io images import OUT`; its
# name is NAME (default tether:latest, as the manifests name it).
#
#   deploy/image.sh BIN_DIR OUT [NAME]
#
# `./dev image` runs it on a release build. Binaries are copied stripped of
# debug information, so a debug build (the tests') makes a usable image too.
# The layer is reproducible: sorted names, time 0.
set -euo pipefail

bin_dir=$1 out=$2 name=${3:-tether:latest}
# What deploy/Dockerfile copies into /usr/local/bin, in its order.
BINARIES=(tetherd lockctl tether-bridge tether-extender tether-device-plugin)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root=$work/rootfs
mkdir -p "$root/usr/local/bin" "$root/etc/ssl/certs" "$root/var/lib/tether" "$root/tmp"
chmod 1777 "$root/tmp"

for binary in "${BINARIES[@]}"; do
    [ -x "$bin_dir/$binary" ] || { echo "image.sh: $bin_dir/$binary is missing" >&2; exit 1; }
    objcopy --strip-debug "$bin_dir/$binary" "$root/usr/local/bin/$binary"
done
# Every shared library the binaries link, and the loader, at their paths.
for lib in $(ldd "${BINARIES[@]/#/$root/usr/local/bin/}" |
    awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// && $1 !~ /:$/ { print $1 }' | sort -u); do
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
done
# /lib64 and /lib are links into /usr on Debian: keep the same shape.
for link in lib lib64; do
    if [ -L "/$link" ] && [ -d "$root/$link" ] && [ ! -L "$root/$link" ]; then
        mkdir -p "$root/usr/$link"
        cp -a "$root/$link/." "$root/usr/$link/"
        rm -rf "${root:?}/$link"
        ln -s "usr/$link" "$root/$link"
    fi
done
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"
printf 'root:x:0:0:root:/root:/usr/sbin/nologin\ntether:x:10001:10001::/var/lib/tether:/usr/sbin/nologin\n' >"$root/etc/passwd"
printf 'root:x:0:\ntether:x:10001:\n' >"$root/etc/group"
chown 10001:10001 "$root/var/lib/tether"

mkdir -p "$work/oci/blobs/sha256"
# Owners as they are (root, and the tether user's directory).
tar --sort=name --mtime=@0 --numeric-owner -C "$root" -cf "$work/layer.tar" .
digest() { sha256sum "$1" | cut -d' ' -f1; }
size() { stat -c %s "$1"; }
layer=$(digest "$work/layer.tar")
mv "$work/layer.tar" "$work/oci/blobs/sha256/$layer"

cat >"$work/config.json" <<EOF
{"architecture":"amd64","os":"linux","config":{"User":"10001","WorkingDir":"/var/lib/tether","Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],"Cmd":["tetherd"],"ExposedPorts":{"7420/tcp":{},"7421/tcp":{}},"Volumes":{"/var/lib/tether":{}}},"rootfs":{"type":"layers","diff_ids":["sha256:$layer"]},"history":[{"created_by":"deploy/image.sh"}]}
EOF
config=$(digest "$work/config.json")
config_size=$(size "$work/config.json")
mv "$work/config.json" "$work/oci/blobs/sha256/$config"

cat >"$work/manifest.json" <<EOF
{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:$config","size":$config_size},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:$layer","size":$(size "$work/oci/blobs/sha256/$layer")}]}
EOF
manifest=$(digest "$work/manifest.json")
manifest_size=$(size "$work/manifest.json")
mv "$work/manifest.json" "$work/oci/blobs/sha256/$manifest"

# The name as the kubelet asks containerd for it (docker.io/library/...).
full=$name
case $full in
    */*/*) ;;
    */*) full=docker.io/$full ;;
    *) full=docker.io/library/$full ;;
esac
cat >"$work/oci/index.json" <<EOF
{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:$manifest","size":$manifest_size,"annotations":{"io.containerd.image.name":"$full","org.opencontainers.image.ref.name":"${name##*:}"}}]}
EOF
printf '{"imageLayoutVersion":"1.0.0"}\n' >"$work/oci/oci-layout"
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$work/oci" -cf "$out" .
echo "image.sh: $full ($(du -h "$out" | cut -f1)) in $out"

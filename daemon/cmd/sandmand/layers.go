package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// layersDir is where overlay-exec binds a sandbox's layers, in its private mount
// namespace, before it mounts the overlay from them: the overlay's mount options
// (which the sandbox reads in /proc/self/mountinfo) then name these few short,
// constant paths, never a host path or a sandbox id. Short paths also keep many
// stacked layers within the one page the kernel takes for mount options.
const layersDir = "/run/sandman-layers"

// maxLowers is overlayfs' limit of stacked lower layers (OVL_MAX_STACK).
const maxLowers = 500

// mountLayers mounts at target an overlay of lowers (topmost first) under upper,
// with work as its work directory. Call it in a private mount namespace: each
// layer is bound at layersDir/<n> on a tmpfs of its own first, and that tmpfs is
// detached once the overlay holds the layers. With ns, every layer (upper and work
// too) is bound idmapped into that user namespace, and the overlay is mounted as
// its root (`withFsids`): the sandbox sees the image's files with their own owners,
// and the upper layer on disk holds the ids the sandbox sees, not host ones.
func mountLayers(lowers []string, upper, work, target string, ns *userns) error {
	if len(lowers) == 0 || len(lowers) > maxLowers {
		return fmt.Errorf("an overlay takes 1 to %d lower layers, not %d", maxLowers, len(lowers))
	}
	for _, p := range append(append([]string{}, lowers...), upper, work) {
		if !filepath.IsAbs(p) || strings.ContainsAny(p, ",:") {
			return fmt.Errorf("overlay path %q must be absolute, without ',' or ':'", p)
		}
	}
	// The mount point itself is made on the host (a directory, not a mount); what
	// is mounted on it exists in this namespace alone.
	if err := os.MkdirAll(layersDir, 0o700); err != nil {
		return err
	}
	if err := syscall.Mount("sandman-layers", layersDir, "tmpfs", syscall.MS_NOSUID|syscall.MS_NODEV|syscall.MS_NOEXEC, "mode=0700,size=64k"); err != nil {
		return fmt.Errorf("mount a tmpfs at %s: %w", layersDir, err)
	}
	bind := func(source, name string) (string, error) {
		point := filepath.Join(layersDir, name)
		if err := os.Mkdir(point, 0o700); err != nil {
			return "", err
		}
		if ns != nil {
			return point, bindIdmapped(source, point, ns)
		}
		if err := syscall.Mount(source, point, "", syscall.MS_BIND, ""); err != nil {
			return "", fmt.Errorf("bind %s: %w", source, err)
		}
		return point, nil
	}
	names := make([]string, len(lowers))
	for i, lower := range lowers {
		point, err := bind(lower, strconv.Itoa(i))
		if err != nil {
			return err
		}
		names[i] = point
	}
	// upper and work on one bind of their common parent: overlayfs wants both on
	// one mount.
	if filepath.Dir(upper) != filepath.Dir(work) {
		return fmt.Errorf("upper %s and work %s must share a directory", upper, work)
	}
	layer, err := bind(filepath.Dir(upper), "w")
	if err != nil {
		return err
	}
	opts := "lowerdir=" + strings.Join(names, ":") +
		",upperdir=" + filepath.Join(layer, filepath.Base(upper)) +
		",workdir=" + filepath.Join(layer, filepath.Base(work))
	mount := func() error { return syscall.Mount("overlay", target, "overlay", 0, opts) }
	if ns != nil {
		mount = func() error {
			return withFsids(ns.base, func() error { return syscall.Mount("overlay", target, "overlay", 0, opts) })
		}
	}
	if err := mount(); err != nil {
		return fmt.Errorf("mount overlay on %s: %w", target, err)
	}
	// The overlay holds its layers now: their binds go from this namespace's view.
	if err := syscall.Unmount(layersDir, syscall.MNT_DETACH); err != nil {
		return fmt.Errorf("detach %s: %w", layersDir, err)
	}
	return nil
}

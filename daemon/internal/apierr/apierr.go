// Package apierr is the daemon's error type: a stable code and an HTTP status,
// shared by the packages that do the work and the server that reports it.
package apierr

import (
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"syscall"
)

// Error is an error the client can act on.
type Error struct {
	Status  int
	Code    string
	Message string
}

func (e *Error) Error() string { return e.Code + ": " + e.Message }

// New builds an *Error.
func New(status int, code, format string, args ...any) *Error {
	return &Error{Status: status, Code: code, Message: fmt.Sprintf(format, args...)}
}

// Constructors for the codes used from more than one place.
func InvalidRequest(format string, args ...any) *Error {
	return New(http.StatusBadRequest, "invalid_request", format, args...)
}

func InvalidPath(format string, args ...any) *Error {
	return New(http.StatusBadRequest, "invalid_path", format, args...)
}

func NotFound(format string, args ...any) *Error {
	return New(http.StatusNotFound, "not_found", format, args...)
}

func Internal(format string, args ...any) *Error {
	return New(http.StatusInternalServerError, "internal", format, args...)
}

// FromOS maps an error from the OS to its protocol code; anything unknown is
// internal. An *Error passes through unchanged.
func FromOS(err error) *Error {
	var ae *Error
	if errors.As(err, &ae) {
		return ae
	}
	msg := err.Error()
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		switch {
		case errors.Is(err, fs.ErrNotExist):
			errno = syscall.ENOENT
		case errors.Is(err, fs.ErrPermission):
			errno = syscall.EACCES
		case errors.Is(err, fs.ErrExist):
			errno = syscall.EEXIST
		}
	}
	switch errno {
	case syscall.ENOENT:
		return New(http.StatusNotFound, "not_found", "%s", msg)
	case syscall.EACCES, syscall.EPERM, syscall.EROFS:
		return New(http.StatusForbidden, "permission_denied", "%s", msg)
	case syscall.EEXIST:
		return New(http.StatusConflict, "already_exists", "%s", msg)
	case syscall.ENOSPC, syscall.EDQUOT:
		return New(http.StatusInsufficientStorage, "no_space", "%s", msg)
	case syscall.ENOTEMPTY:
		return New(http.StatusConflict, "directory_not_empty", "%s", msg)
	case syscall.EISDIR:
		return New(http.StatusBadRequest, "is_a_directory", "%s", msg)
	case syscall.ENOTDIR:
		return New(http.StatusBadRequest, "not_a_directory", "%s", msg)
	case syscall.ENAMETOOLONG, syscall.EINVAL, syscall.ELOOP:
		return New(http.StatusBadRequest, "invalid_path", "%s", msg)
	}
	return Internal("%s", msg)
}

// FromOSOrNil is FromOS that keeps nil as an untyped nil error.
func FromOSOrNil(err error) error {
	if err == nil {
		return nil
	}
	return FromOS(err)
}
